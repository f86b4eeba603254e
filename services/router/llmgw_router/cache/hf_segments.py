"""The piece cache: rendered chat text tokenized piece by piece between the template's control tokens."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping

from tokenizers import Tokenizer


class Segments:
    """Rendered chat text tokenized piece by piece between the template's control tokens, each piece's ids
    kept (LRU, bounded in characters). Exact: ``tokenizers`` itself cuts the text at every special added
    token before it normalizes, pre-tokenizes and runs the model on each piece alone, so the pieces'
    ids joined are the whole text's. Only tokens that no other added token overlaps are cut at, and not
    for a Metaspace ``prepend_scheme: first`` (its prefix goes to the text's first piece only).

    Why: tokenizing a 2,000-token Gemma prompt costs about 2 ms of CPU here, nearly all of it the BPE
    model (``bench/tokenize_cost.py``), against 0.06 ms for the rendering. A conversation's next turn
    re-sends every earlier message, each rendered the same: only the new ones cost."""

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
    ) -> Segments | None:
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
