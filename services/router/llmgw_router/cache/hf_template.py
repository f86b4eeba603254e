"""A chat template as transformers 5 renders it, and vLLM's content-format detection from its AST.

Compiled once per template (:class:`Compiled`), in transformers' sandbox: ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, its ``tojson``, ``raise_exception``, ``strftime_now`` and the
``{% generation %}`` block."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from llmgw_router.cache.hf_messages import ContentFormat


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


def environment(now: Callable[[], datetime]) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    return env


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


class Compiled:
    """A template compiled once, with what vLLM reads from its source."""

    __slots__ = ("compiled", "content_format", "developer_role", "source", "variables")

    def __init__(self, env: jinja2.Environment, source: str) -> None:
        self.source = source
        self.compiled = env.from_string(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        self.content_format = detect_content_format(env, source)
        self.developer_role = '"developer"' in source or "'developer'" in source
