"""vLLM's runtime LoRA API: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

Served where the options ask for LoRA (``max_loras``), as vLLM serves them only with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (elsewhere the paths are its bare 404).
Bodies are vLLM's: ``{"lora_name", "lora_path", "load_inplace"}`` and ``{"lora_name"}``; success is a
200 with a plain sentence, a refusal vLLM's error body (:class:`llmgw_sim.lora.LoadRefused`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llmgw_sim import errors
from llmgw_sim.engine import Engine
from llmgw_sim.lora import Adapters, LoadRefused


def add(app: web.Application, engine: Engine) -> None:
    adapters = engine.lora
    if adapters is None or not engine.opts.generates:
        return
    routes = LoraRoutes(engine, adapters)
    app.router.add_post("/v1/load_lora_adapter", routes.load)
    app.router.add_post("/v1/unload_lora_adapter", routes.unload)


def _string(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if value is None:
        raise errors.missing(field, body)
    if not isinstance(value, str):
        raise errors.invalid(field, "string_type", "Input should be a valid string", value)
    return value


class LoraRoutes:
    def __init__(self, engine: Engine, adapters: Adapters) -> None:
        self.engine = engine
        self.adapters = adapters

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await self.engine.read_json(request)
            name = _string(body, "lora_name")
            path = _string(body, "lora_path")
            inplace = body.get("load_inplace", False)
            if not isinstance(inplace, bool):
                raise errors.invalid("load_inplace", "bool_type", "Input should be a valid boolean", inplace)
        except errors.BadRequest as err:
            return errors.bad_request(err)
        try:
            await self.adapters.load(name, path, inplace)
        except LoadRefused as e:
            return errors.error(e.status, str(e), e.type)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = await self.engine.read_json(request)
            name = _string(body, "lora_name")
        except errors.BadRequest as err:
            return errors.bad_request(err)
        try:
            self.adapters.unload(name)
        except LoadRefused as e:
            return errors.error(e.status, str(e), e.type)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
