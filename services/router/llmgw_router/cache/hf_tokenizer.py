"""A request's prompt token ids as vLLM 0.32 computes them, from the model's own tokenizer files.

KV-aware routing names a request's prefix blocks by the token ids the engine will cache; a router that
tokenized differently (another template, a BOS more or less, content parts joined another way) would
predict blocks no engine ever stores. So this follows vLLM's chat path step by step (its
``renderers/chat_utils.py`` and ``renderers/hf.py``, and transformers 5's ``apply_chat_template``):

- the template: the processor's (``chat_template.json``) when the request has no tools, else
  ``chat_template.jinja``, else ``tokenizer_config.json``'s (a named set: ``tool_use`` with tools, else
  ``default``);
- the content format, detected from the template's AST as vLLM does: ``openai`` (content stays a list of
  ``{"type": "text", "text": ...}``, a string becoming one such part) when the template loops over a
  message's content, else ``string`` (text parts joined with ``"\\n"``);
- the messages as vLLM rebuilds them (role, content, ``name``, ``tool_calls`` with their arguments
  parsed, ``reasoning``, ``tool_call_id``; ``developer`` turned into ``system`` where the template has no
  such role);
- the template's variables: the named special tokens, ``add_generation_prompt`` (default true),
  ``continue_final_message``, ``documents``, ``reasoning_effort`` (and ``enable_thinking``), and the
  ``chat_template_kwargs`` the template reads, merged in vLLM's order;
- rendered in transformers' sandbox (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its
  ``tojson``, ``raise_exception`` and ``strftime_now``), and tokenized with ``tokenizers`` without adding
  special tokens (the template writes BOS itself). A completion's string prompt is tokenized with them
  (``add_special_tokens`` true); token ids are taken as they are.

What it cannot predict it answers None for, and the router routes that request on load alone: images,
audio and other media, several prompts in one request, ``suffix``, prompt embeddings, truncation, a
request's own chat template, tools where the template reads them (vLLM renders the validated pydantic
dump), and anything the template refuses (vLLM answers 400 there).

Cost, CPU time (``time.thread_time``) on this 2-core machine shared with other builds (load 5-9),
gemma-3-270m's files, chats of about 2,000 tokens (a system prompt, four exchanges, a question; all new
text), medians (``tests/router/cache/test_hf_tokenizer.py::test_cost_of_a_two_thousand_token_chat``):

- rendering the template: 0.06-0.11 ms (compiled once per template); it is not what costs;
- a cold prompt (no text seen before): 2.1-3.1 ms, nearly all of it the ``tokenizers`` library's BPE
  model itself: ``bench/tokenize_cost.py`` runs the model alone (no normalizer, pre-tokenizer or
  post-processor, on text already normalized) at ~0.8 µs a token, 0.9x of the whole encode; cutting the
  text into words first (exact for Gemma) saves nothing, and ``encode_batch_fast`` saves ~20 % but starts
  a thread pool in the router. So 1 ms for wholly new 2,000-token text is out of reach of this library
  on this machine; what can be reused is (next point);
- the next turn of a conversation (its history seen on the turn before, one new exchange): 0.10 ms,
  because the rendered text is tokenized piece by piece between the template's control tokens and each
  piece's ids are kept (:class:`Segments`, bounded by ``cache_chars``; exact, since ``tokenizers``
  itself cuts there);
- a 2,000-token completion prompt (``add_special_tokens``: no piece cache): 2-4 ms.

Not thread-safe (the piece cache): one instance per event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Literal

import jinja2
from tokenizers import Tokenizer

from llmgw_router.cache.hf_files import special_tokens, templates
from llmgw_router.cache.hf_messages import (
    ContentFormat,
    Unpredictable,
    conversation,
    cut_at_tag,
    tag_final,
    without_developer,
)
from llmgw_router.cache.hf_segments import Segments
from llmgw_router.cache.hf_template import Compiled, environment

# apply_chat_template's own parameters: never template variables, whatever the kwargs say.
_APPLY_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "messages",
    }
)
# merge_kwargs' "not given" values: an override holding one of these leaves the default.
_UNSET: tuple[object, ...] = (None, "auto")


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``overrides`` win, except where they hold None or ``"auto"``."""
    return {**(defaults or {}), **{k: v for k, v in (overrides or {}).items() if v not in _UNSET}}


# ------------------------------------------------------------------ the tokenizer


class HfPromptTokenizer:
    """One model's prompt tokenizer, built from its files' bytes (see :data:`TOKENIZER_FILES`).

    ``content_format`` is vLLM's ``--chat-template-content-format`` (``auto``: detected from the
    template); ``default_chat_template_kwargs`` its ``--default-chat-template-kwargs``. ``now`` is the
    clock of templates that call ``strftime_now`` (the engine's own clock decides there: a prediction
    made across midnight can miss). ``cache_chars`` bounds the rendered text whose tokens are kept
    (:class:`Segments`: a conversation's earlier turns are not tokenized again)."""

    def __init__(
        self,
        files: Mapping[str, bytes],
        *,
        content_format: Literal["auto", "string", "openai"] = "auto",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        now: Callable[[], datetime] = datetime.now,
        cache_chars: int = 4 << 20,
    ) -> None:
        if "tokenizer.json" not in files:
            raise ValueError("no tokenizer.json among the tokenizer's files")
        self._tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
        self._specials = special_tokens(files)
        self._segments: Segments | None = None
        self._defaults = dict(default_chat_template_kwargs or {})
        self._env = environment(now)
        processor, tokenizer_template = templates(files)
        self._processor = self._compile(processor) if processor is not None else None
        self._default: Compiled | None = None
        self._tool_use: Compiled | None = None
        if isinstance(tokenizer_template, str):
            self._default = self._compile(tokenizer_template)
        elif isinstance(tokenizer_template, dict):
            if "default" in tokenizer_template:
                self._default = self._compile(tokenizer_template["default"])
            if "tool_use" in tokenizer_template:
                self._tool_use = self._compile(tokenizer_template["tool_use"])
        self._forced_format: ContentFormat | None = None if content_format == "auto" else content_format
        sources = [t.source for t in (self._processor, self._default, self._tool_use) if t is not None]
        if sources:
            self._segments = Segments.build(self._tokenizer, sources, self._specials, cache_chars)

    def _compile(self, source: str) -> Compiled:
        return Compiled(self._env, source)

    @property
    def chat_template_present(self) -> bool:
        return self._processor is not None or self._default is not None or self._tool_use is not None

    def close(self) -> None:
        """Nothing to release (the tokenizer is memory only); here so callers can treat every kind alike."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text``'s ids, as ``tokenizers`` gives them; without special tokens added, from the segment
        cache where the tokenizer allows one."""
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(text)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    @property
    def cached_chars(self) -> int:
        return 0 if self._segments is None else self._segments.chars

    def prompt_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None when they cannot be predicted.

        ``body`` is an OpenAI ``/v1/chat/completions`` (``messages``) or ``/v1/completions`` (``prompt``)
        body as the engine receives it; other APIs' bodies (Anthropic's ``/v1/messages``, responses)
        are the caller's to convert or to leave unpredicted."""
        try:
            if "messages" in body:
                return self._chat_ids(body)
            if "prompt" in body:
                return self._completion_ids(body)
        except Unpredictable:
            return None
        return None

    def render_chat(self, body: Mapping[str, Any]) -> str | None:
        """The chat prompt's text as the template renders it (before tokenizing), or None."""
        try:
            return self._render(body)
        except Unpredictable:
            return None

    # -------------------------------------------------------------- completions

    def _completion_ids(self, body: Mapping[str, Any]) -> list[int]:
        if (
            body.get("suffix")
            or body.get("prompt_embeds") is not None
            or body.get("truncate_prompt_tokens") is not None
        ):
            raise Unpredictable
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list: the same request
        if isinstance(prompt, str):
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise Unpredictable
            return self.encode(prompt, add_special_tokens=add)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        raise Unpredictable  # several prompts (a batch of requests), or not a prompt vLLM takes

    # -------------------------------------------------------------- chat

    def _chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        text = self._render(body)
        add = body.get("add_special_tokens", False)
        if not isinstance(add, bool):
            raise Unpredictable
        return self.encode(text, add_special_tokens=add)

    def _template_kwargs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``build_chat_params(...).with_defaults(...)``: the request's options over its
        ``chat_template_kwargs``, over the server's defaults and the tools."""
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, dict) or "chat_template" in user or "tokenize" in user:
            raise Unpredictable  # vLLM refuses a request's own template; tokenize changes the path
        effort = body.get("reasoning_effort")
        extra: dict[str, Any] = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
        tools = body.get("tools")
        defaults = merge_kwargs(self._defaults, {"tools": tools})
        return merge_kwargs(defaults, merge_kwargs(user, extra))

    def _render(self, body: Mapping[str, Any]) -> str:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or body.get("chat_template") is not None:
            raise Unpredictable
        if body.get("truncate_prompt_tokens") is not None:
            raise Unpredictable
        kwargs = self._template_kwargs(body)
        tools = kwargs.pop("tools", None)
        template = self._choose(tools)
        if tools is not None and "tools" in template.variables:
            raise Unpredictable  # the template reads vLLM's pydantic dump of each tool
        fmt = self._forced_format or template.content_format
        chat = conversation(messages, fmt)
        if template.developer_role is False and any(m["role"] == "developer" for m in chat):
            chat = without_developer(chat)
        add_generation_prompt = bool(kwargs.get("add_generation_prompt", False))
        continue_final = kwargs.get("continue_final_message", False)
        if continue_final and add_generation_prompt:
            raise Unpredictable  # transformers refuses both
        documents = kwargs.get("documents")
        if documents is not None and not (
            isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
        ):
            raise Unpredictable
        context = {**self._specials}
        context.update(
            (k, v) for k, v in kwargs.items() if k in template.variables and k not in _APPLY_PARAMS
        )
        final_text: str | None = None
        if continue_final:
            final_text, chat = tag_final(chat, template.source)
        try:
            rendered = template.compiled.render(
                messages=chat,
                tools=None,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise Unpredictable from e  # the engine answers such a request 400
        if final_text is not None:
            rendered = cut_at_tag(rendered, final_text)
        return rendered

    def _choose(self, tools: Any) -> Compiled:
        if tools is None and self._processor is not None:
            return self._processor
        if tools is not None and self._tool_use is not None:
            return self._tool_use
        if self._default is None:
            raise Unpredictable  # no template: vLLM refuses chat
        return self._default
