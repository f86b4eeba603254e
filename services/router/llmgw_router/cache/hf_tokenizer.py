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
- a cold prompt (no text seen before): 2.1-3.1 ms, nearly all of it ``tokenizers`` (Gemma's normalizer
  turns spaces into "▁" before its pre-tokenizer could split on them, so its BPE sees one 8,000-character
  word, and the normalizer alone takes 0.4 ms);
- the next turn of a conversation (its history seen on the turn before, one new exchange): 0.10 ms,
  because the rendered text is tokenized piece by piece between the template's control tokens and each
  piece's ids are kept (:class:`_Segments`, bounded by ``cache_chars``; exact, since ``tokenizers``
  itself cuts there);
- a 2,000-token completion prompt (``add_special_tokens``: no piece cache): 2-4 ms.

Not thread-safe (the piece cache): one instance per event loop.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer

ContentFormat = Literal["string", "openai"]

# The files a router needs, as the model directory names them (the agent publishes these).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
)

# transformers 5's named special tokens, the ones apply_chat_template hands to every template.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
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
# vLLM's content part types read as text, and the key holding each one's text.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# The fields vLLM knows in a content part (its _KNOWN_CONTENT_PART_FIELDS): any other field of a text part
# is kept beside its text in the openai format.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
# Claude Code's first system line changes on every request; vLLM drops it (a prefix-cache killer).
_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# merge_kwargs' "not given" values: an override holding one of these leaves the default.
_UNSET: tuple[object, ...] = (None, "auto")


class _Unpredictable(Exception):
    """This request's tokens cannot be known here (the router routes it on load alone)."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block (it marks assistant text for training masks): here it only
    renders its body, so that templates using it parse and render the same."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' own tojson: jinja's escapes HTML characters, which templates do not expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment(now: Callable[[], datetime]) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    return env


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``overrides`` win, except where they hold None or ``"auto"``."""
    return {**(defaults or {}), **{k: v for k, v in (overrides or {}).items() if v not in _UNSET}}


# ------------------------------------------------------------------ the tokenizer's files


def _json(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    raw = files.get(name)
    if raw is None:
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as a config holds it: a string, or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def special_tokens(files: Mapping[str, bytes]) -> dict[str, str]:
    """The named special tokens transformers passes to a chat template (``bos_token``, ...): from
    ``tokenizer_config.json``, else ``special_tokens_map.json``, plus a multimodal tokenizer's named
    extra tokens (``image_token``, ...)."""
    config = _json(files, "tokenizer_config.json")
    mapped = _json(files, "special_tokens_map.json")
    out: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name, mapped.get(name)))
        if text is not None:
            out[name] = text
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, dict):
            for name, value in extra.items():
                text = _token_text(value)
                if text is not None:
                    out[str(name)] = text
    return out


def _templates(files: Mapping[str, bytes]) -> tuple[str | None, str | dict[str, str] | None]:
    """(the processor's template, the tokenizer's template or named set)."""
    processor: str | None = None
    if "chat_template.json" in files:
        value = _json(files, "chat_template.json").get("chat_template")
        processor = value if isinstance(value, str) else None
    if "chat_template.jinja" in files:
        return processor, files["chat_template.jinja"].decode()
    config = _json(files, "tokenizer_config.json").get("chat_template")
    if isinstance(config, str):
        return processor, config
    if isinstance(config, list):
        named = {str(t["name"]): str(t["template"]) for t in config if isinstance(t, dict) and "name" in t}
        return processor, named or None
    return processor, None


# ------------------------------------------------------------------ vLLM's content-format detection
# A port of vllm/renderers/hf.py's _detect_content_format: "openai" when the template loops over a
# message's content (or a macro parameter bound to it), else "string".


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: jinja2.nodes.Template, name: str) -> Iterator[str]:
    yield name
    related = deque([name])
    while related:
        current = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    related.append(assign.target.name)


def _message_names(root: jinja2.nodes.Template) -> Iterator[str]:
    messages = list(_names_bound_to(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, m) for m in messages) and isinstance(
            loop.target, jinja2.nodes.Name
        ):
            yield loop.target.name


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    messages = list(_message_names(root))
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {a.name for a in macro.args}
        bound: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content") for m in messages):
                    bound.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and any(_is_var_or_elems(kw.value, m, "content") for m in messages):
                    bound.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if bound:
                params_by_loop[id(loop)] = bound
    for loop in root.find_all(jinja2.nodes.For):
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if any(_is_var_or_elems(loop.iter, m, "content") for m in messages):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            bound_params = params_by_loop.get(id(loop))
            if bound_params is not None and loop.iter.name in bound_params:
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


def detect_content_format(env: jinja2.Environment, template: str) -> ContentFormat:
    """vLLM's ``auto`` content format for ``template``."""
    try:
        root = env.parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if _loops_over_content(root) else "string"


# ------------------------------------------------------------------ the messages as vLLM rebuilds them


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = (
            part
            if isinstance(part, str)
            else part.get("text")
            if isinstance(part, dict) and part.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(role: str, content: Any, fmt: ContentFormat) -> str | list[dict[str, Any]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise _Unpredictable
    if role == "system":
        parts = _strip_billing_header(parts)
    texts: list[str] = []
    wrapped: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            wrapped.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict) or part.get("uuid") is not None:
            raise _Unpredictable
        part_type = part.get("type")
        key = _TEXT_PART_KEYS.get(part_type) if isinstance(part_type, str) else None
        if key is None:
            raise _Unpredictable  # media, tool references, unknown parts
        text = part.get(key)
        if text is None and part_type in ("text", "refusal"):
            continue  # vLLM skips a text part without text
        if not isinstance(text, str):
            raise _Unpredictable
        texts.append(text)
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        wrapped.append({"type": "text", "text": text, **extra})
    return wrapped if fmt == "openai" else "\n".join(texts)


def _tool_calls(calls: Any) -> list[Any] | None:
    if not isinstance(calls, list):
        raise _Unpredictable
    if not calls:
        return None  # vLLM drops an empty list
    out: list[Any] = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise _Unpredictable  # vLLM refuses these
        args = function.get("arguments")
        if not args:
            parsed: Any = {}
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = {}
        else:
            parsed = args
        out.append(
            {**call, "function": {**function, "arguments": parsed if isinstance(parsed, dict) else {}}}
        )
    return out


def conversation(messages: list[Any], fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages a chat template sees, as vLLM's ``parse_chat_messages`` builds them."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(role := message.get("role"), str):
            raise _Unpredictable
        msg: dict[str, Any] = {"role": role, "content": _content(role, message.get("content"), fmt)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = _tool_calls(message["tool_calls"])
                if calls is not None:
                    msg["tool_calls"] = calls
            if (reasoning := message.get("reasoning")) is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list):  # vLLM flattens a tool result's text parts
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def _without_developer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``developer`` -> ``system`` for templates without that role, system turns then merged."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in messages
    ]
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else str(p) for p in content)
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


# ------------------------------------------------------------------ the tokenizer


class HfPromptTokenizer:
    """One model's prompt tokenizer, built from its files' bytes (see :data:`TOKENIZER_FILES`).

    ``content_format`` is vLLM's ``--chat-template-content-format`` (``auto``: detected from the
    template); ``default_chat_template_kwargs`` its ``--default-chat-template-kwargs``. ``now`` is the
    clock of templates that call ``strftime_now`` (the engine's own clock decides there: a prediction
    made across midnight can miss). ``cache_chars`` bounds the rendered text whose tokens are kept
    (:class:`_Segments`: a conversation's earlier turns are not tokenized again)."""

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
        self._segments: _Segments | None = None
        self._defaults = dict(default_chat_template_kwargs or {})
        self._env = _environment(now)
        processor, tokenizer_template = _templates(files)
        self._processor = self._compile(processor) if processor is not None else None
        self._default: _Compiled | None = None
        self._tool_use: _Compiled | None = None
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
            self._segments = _Segments.build(self._tokenizer, sources, self._specials, cache_chars)

    def _compile(self, source: str) -> _Compiled:
        return _Compiled(self._env, source)

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
        except _Unpredictable:
            return None
        return None

    def render_chat(self, body: Mapping[str, Any]) -> str | None:
        """The chat prompt's text as the template renders it (before tokenizing), or None."""
        try:
            return self._render(body)
        except _Unpredictable:
            return None

    # -------------------------------------------------------------- completions

    def _completion_ids(self, body: Mapping[str, Any]) -> list[int]:
        if (
            body.get("suffix")
            or body.get("prompt_embeds") is not None
            or body.get("truncate_prompt_tokens") is not None
        ):
            raise _Unpredictable
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list: the same request
        if isinstance(prompt, str):
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise _Unpredictable
            return self.encode(prompt, add_special_tokens=add)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        raise _Unpredictable  # several prompts (a batch of requests), or not a prompt vLLM takes

    # -------------------------------------------------------------- chat

    def _chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        text = self._render(body)
        add = body.get("add_special_tokens", False)
        if not isinstance(add, bool):
            raise _Unpredictable
        return self.encode(text, add_special_tokens=add)

    def _template_kwargs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``build_chat_params(...).with_defaults(...)``: the request's options over its
        ``chat_template_kwargs``, over the server's defaults and the tools."""
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, dict) or "chat_template" in user or "tokenize" in user:
            raise _Unpredictable  # vLLM refuses a request's own template; tokenize changes the path
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
            raise _Unpredictable
        if body.get("truncate_prompt_tokens") is not None:
            raise _Unpredictable
        kwargs = self._template_kwargs(body)
        tools = kwargs.pop("tools", None)
        template = self._choose(tools)
        if tools is not None and "tools" in template.variables:
            raise _Unpredictable  # the template reads vLLM's pydantic dump of each tool
        fmt = self._forced_format or template.content_format
        chat = conversation(messages, fmt)
        if template.developer_role is False and any(m["role"] == "developer" for m in chat):
            chat = _without_developer(chat)
        add_generation_prompt = bool(kwargs.get("add_generation_prompt", False))
        continue_final = kwargs.get("continue_final_message", False)
        if continue_final and add_generation_prompt:
            raise _Unpredictable  # transformers refuses both
        documents = kwargs.get("documents")
        if documents is not None and not (
            isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
        ):
            raise _Unpredictable
        context = {**self._specials}
        context.update(
            (k, v) for k, v in kwargs.items() if k in template.variables and k not in _APPLY_PARAMS
        )
        final_text: str | None = None
        if continue_final:
            final_text, chat = _tag_final(chat, template.source)
        try:
            rendered = template.compiled.render(
                messages=chat,
                tools=None,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise _Unpredictable from e  # the engine answers such a request 400
        if final_text is not None:
            rendered = _cut_at_tag(rendered, final_text)
        return rendered

    def _choose(self, tools: Any) -> _Compiled:
        if tools is None and self._processor is not None:
            return self._processor
        if tools is not None and self._tool_use is not None:
            return self._tool_use
        if self._default is None:
            raise _Unpredictable  # no template: vLLM refuses chat
        return self._default


class _Compiled:
    """A template compiled once, with what vLLM reads from its source."""

    __slots__ = ("compiled", "content_format", "developer_role", "source", "variables")

    def __init__(self, env: jinja2.Environment, source: str) -> None:
        self.source = source
        self.compiled = env.from_string(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        self.content_format = detect_content_format(env, source)
        self.developer_role = '"developer"' in source or "'developer'" in source


def _tag_final(chat: list[dict[str, Any]], source: str) -> tuple[str, list[dict[str, Any]]]:
    """transformers' continue_final_message: a tag after the last message's text, cut off after render."""
    if "content" not in source:
        raise _Unpredictable
    last = dict(chat[-1])
    content = last.get("content")
    if isinstance(content, list):
        parts = [dict(p) for p in content]
        for part in reversed(parts):
            if "text" in part:
                final = str(part["text"])
                part["text"] = final + _CONTINUE_TAG
                break
        else:
            raise _Unpredictable
        last["content"] = parts
    elif isinstance(content, str):
        final = content
        last["content"] = content + _CONTINUE_TAG
    else:
        raise _Unpredictable
    return final, [*chat[:-1], last]


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise _Unpredictable
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


class _Segments:
    """Rendered chat text tokenized piece by piece between the template's control tokens, each piece's ids
    kept (LRU, bounded in characters). Exact: ``tokenizers`` itself cuts the text at every special added
    token before it normalizes, pre-tokenizes and runs the model on each piece alone, so the pieces'
    ids joined are the whole text's. Only tokens that no other added token overlaps are cut at, and not
    for a Metaspace ``prepend_scheme: first`` (its prefix goes to the text's first piece only).

    Why: a 2,000-token Gemma prompt is one 8,000-character word to its BPE (the normalizer turns spaces
    into "▁" before the pre-tokenizer could split on them): about 2 ms of CPU here, against 0.2 ms for
    the rendering. A conversation's next turn re-sends every earlier message, each rendered the same:
    only the new ones cost."""

    def __init__(self, tokenizer: Tokenizer, cut: Mapping[str, int], max_chars: int) -> None:
        self._tokenizer = tokenizer
        self._ids = dict(cut)
        self._pattern = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(cut, key=len, reverse=True)) + ")"
        )
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._max_chars = max_chars
        self.chars = 0

    @classmethod
    def build(
        cls, tokenizer: Tokenizer, templates: list[str], specials: Mapping[str, str], max_chars: int
    ) -> _Segments | None:
        if max_chars <= 0 or "prepend_scheme=first" in repr(tokenizer.pre_tokenizer):
            return None
        added = list(tokenizer.get_added_tokens_decoder().items())
        contents = [t.content for _, t in added]
        cut: dict[str, int] = {}
        for token_id, t in added:
            plain = t.special and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
            used = t.content in specials.values() or any(t.content in source for source in templates)
            if (
                plain
                and used
                and len(t.content) > 1
                and not any(_overlaps(t.content, o) for o in contents if o != t.content)
            ):
                cut[t.content] = token_id
        if not cut:
            return None
        segments = cls(tokenizer, cut, max_chars)
        # A check of the claim on this tokenizer: text around every cut token, cut and whole.
        probe = "".join(f"Hi, a  b\n{t} c\n\n d." for t in cut) + " end"
        if segments.encode(probe) != tokenizer.encode(probe, add_special_tokens=False).ids:
            return None
        segments._cache.clear()
        segments.chars = 0
        return segments

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for i, piece in enumerate(self._pattern.split(text)):
            if i % 2:
                out.append(self._ids[piece])
            elif piece:
                out += self._piece(piece)
        return out

    def _piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            return ids
        ids = self._tokenizer.encode(piece, add_special_tokens=False).ids
        if len(piece) <= self._max_chars:
            self._cache[piece] = ids
            self.chars += len(piece)
            while self.chars > self._max_chars:
                old, _ = self._cache.popitem(last=False)
                self.chars -= len(old)
        return ids


def _overlaps(token: str, other: str) -> bool:
    """Whether ``other`` could match across or around an occurrence of ``token``."""
    if token in other:
        return True
    return any(other.endswith(token[:k]) or other.startswith(token[-k:]) for k in range(1, len(token)))
