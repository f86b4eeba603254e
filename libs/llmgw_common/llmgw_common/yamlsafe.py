"""The one YAML loader for text llmgw did not write itself: catalogs, fleet files, static router
files and settings files.

``yaml.safe_load`` refuses code, not size. A 1 KB "billion laughs" document (anchors whose values
alias the previous anchor ten times, nine levels deep) composes into a small graph, but everything
that walks the result (pydantic, msgpack, JSON) walks the expansion: 10^9 nodes, seconds of CPU and
gigabytes of memory in the control plane. :func:`load_yaml` refuses, before anything is constructed:

- a document larger than ``max_bytes``;
- a document whose tree, with every alias expanded, has more than ``max_nodes`` nodes (counted over
  the composed graph with each node's expanded size memoised, so the count costs one pass over what
  was actually written, not over the expansion);
- a recursive alias (an anchor used inside itself: its expansion is infinite);
- nesting deeper than the parser can follow (libyaml refuses it; PyYAML's composer would recurse).

Every refusal is a :class:`YamlError` (a ``yaml.YAMLError``, so callers that already report "not valid
YAML" keep doing so) whose message names the limit.
"""

from __future__ import annotations

import functools
from typing import IO, Any

import yaml

from llmgw_common.errors import InvalidInput

# Larger than any catalog, fleet or settings file we know of; NATS refuses payloads over 1 MiB anyway.
MAX_BYTES = 1024 * 1024
# Nodes after alias expansion. A 1000-model catalog is ~60 000; validating 200 000 takes ~0.1 s.
MAX_NODES = 200_000


class YamlError(yaml.YAMLError, InvalidInput):
    """A document refused by :func:`load_yaml`: too large, expands too far, or nests too deep."""


def expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes in ``root``'s tree with every alias expanded; YamlError once past ``limit`` or on a cycle.

    Iterative post-order walk over the composed graph. A node reached through several aliases is
    the same object each time, so its size is computed once and reused.
    """
    done: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in done:
            continue
        kids = _children(node)
        if not children_done:
            if key in active:
                raise YamlError(f"recursive alias at {node.start_mark}: an anchor is used inside itself")
            active.add(key)
            stack.append((node, True))
            for kid in kids:
                if id(kid) in active and id(kid) not in done:
                    raise YamlError(f"recursive alias at {kid.start_mark}: an anchor is used inside itself")
                if id(kid) not in done:
                    stack.append((kid, False))
            continue
        total = 1 + sum(done[id(k)] for k in kids)
        if total > limit:
            raise YamlError(
                f"document expands to more than {limit} nodes once its aliases are expanded "
                f"(an alias bomb?); refused"
            )
        done[key] = total
        active.discard(key)
    return done[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


# libyaml's parser when built with it (10x faster, and it refuses absurd nesting itself).
_BASE: type[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=8)
def _loader(max_nodes: int) -> type[Any]:
    class BoundedLoader(_BASE):  # type: ignore[misc,valid-type]
        # Called with the composed graph, before any Python object is built from it (both the C and
        # the pure-Python parsers compose first, then call this).
        def construct_document(self, node: yaml.Node) -> Any:
            expanded_size(node, max_nodes)
            return super().construct_document(node)

    return BoundedLoader


def load_yaml(text: str | bytes | IO[str], *, max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES) -> Any:
    """One YAML document, like ``yaml.safe_load``, within the limits above; YamlError otherwise."""
    if not isinstance(text, str | bytes):
        text = text.read(max_bytes + 1)
    if len(text.encode() if isinstance(text, str) else text) > max_bytes:
        raise YamlError(f"document larger than {max_bytes} bytes refused")
    try:
        return yaml.load(text, Loader=_loader(max_nodes))  # a (C)SafeLoader subclass: plain data only
    except RecursionError:
        raise YamlError("document nests too deeply to be read") from None
