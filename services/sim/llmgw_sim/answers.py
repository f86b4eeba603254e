"""The simulator's answers: readable text that is a pure function of the prompt, a salt and a position.

An answer is a walk through a fixed text (:data:`TEXT`, sentences that read on their own), starting at
the sentence a hash of the prompt's last :data:`CONTEXT_WORDS` words and the salt picks, and cycling
through the text when longer. A token is a word (:mod:`llmgw_common.simtokens`). So the same prompt
always gets the same answer, another prompt most likely another one, and a salt (a LoRA adapter's name)
another answer to the same prompt.

A continuation must be the rest of the uninterrupted answer (a router's mid-stream failover is checked
against it). A chat says how much it continues (the final assistant message's words); a completion
is sent back as its prompt plus the text so far, so :func:`answered` finds the cut: the longest tail of
the text that is the start of the answer to what precedes it. Taking the longest makes the cut of a
text plus k more words of its answer exactly k further on: a continuation from any point is the rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["CONTEXT_WORDS", "TEXT", "answer_words", "answered", "start_of"]

TEXT = """\
Hello! This answer comes from the simulated engine of llmgw, not from a real model.
The simulator reads your prompt, picks a sentence of a fixed text by a hash of it, and goes on from there.
The same prompt always gets the same answer, so a stream continued on another replica can be checked word for word.
Each word you read is one token, sent at the pace the model's profile sets.
To hear a real model, add a vLLM or llama.cpp profile to the catalog and apply it with llmgw ctl.
The router chose this replica by its load, and by the prefix of your prompt it may already hold.
An agent on every node starts the engines it is assigned, watches them, and reports their load.
The control plane places replicas on nodes that can hold them, and says why when none can.
A request that fails before its first byte is tried again on another replica.
A stream that breaks in the middle goes on elsewhere from the text already sent.
Nothing here needs a GPU: the nodes and their cards are simulated as well.
The console shows which replicas are ready, and why the others are not.
Keys, quotas and fair shares keep one tenant from taking the whole cluster.
A replica nobody used for a while can be put to sleep, and woken by the next request.
Every alert names what was short, so that the person paged knows where to look.
Logs of every service are in the data directory, one file each.
The river was quiet that morning, and the old bridge held its shadow still.
A good answer is short, says what it knows, and says what it does not.
Tea tastes best when the water has just stopped boiling.
The library opens at nine, and the reading room fills by ten.
Somewhere a train is late, and someone is glad of the extra minute.
A map is not the land, but it helps to have one.
The garden needs rain, and the forecast promises some by Thursday.
Small steps, taken every day, cover a long way in a year.
The last page of a good book is both an end and a beginning.
A note on the café door said "back at noon" 😀, and under it a path: C:\\tea\\kettle.
"""
# The prompt's words that pick the first sentence: enough that prompts differ, bounded for cost.
CONTEXT_WORDS = 32
_PERSON = b"llmgw-simanswer"

_WORDS: tuple[str, ...] = tuple(TEXT.split())
_LEN = len(_WORDS)
# Where sentences begin: an answer starts at one.
_STARTS: tuple[int, ...] = tuple(i for i in range(_LEN) if i == 0 or _WORDS[i - 1][-1] in ".!?")
_IS_START = frozenset(_STARTS)
_AT: dict[str, tuple[int, ...]] = {}
for _i, _w in enumerate(_WORDS):
    _AT[_w] = (*_AT.get(_w, ()), _i)


def start_of(prompt: Sequence[str], end: int, salt: str = "") -> int:
    """Where in :data:`TEXT` the answer to ``prompt[:end]`` begins: a sentence picked by a hash of the
    last :data:`CONTEXT_WORDS` words before ``end`` and the salt (BLAKE2b: the same in every process)."""
    h = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8, person=_PERSON)
    for w in prompt[max(0, end - CONTEXT_WORDS) : end]:
        # NUL never occurs in a word's text from JSON without being escaped to it: a safe separator.
        h.update(b"\x00" + w.encode("utf-8", "surrogatepass"))
    return _STARTS[int.from_bytes(h.digest(), "little") % len(_STARTS)]


def answer_words(prompt: Sequence[str], salt: str = "", position: int = 0, count: int = 16) -> list[str]:
    """Words ``position`` to ``position + count`` of the answer to ``prompt`` (its tokens, the
    simulator's words) under ``salt``."""
    s = start_of(prompt, len(prompt), salt) + position
    return [_WORDS[(s + i) % _LEN] for i in range(count)]


def answered(text: Sequence[str], salt: str = "") -> int:
    """How many of the last words of ``text`` are the start of the answer to the words before them:
    the longest such tail (0 when none is). A completion's prompt plus the text sent so far is cut there.

    Only tails that run through :data:`TEXT` in order from a sentence start are candidates, so a text
    not ending in the simulator's words costs one dictionary lookup.
    """
    n = len(text)
    best = 0
    for q in _AT.get(text[-1], ()) if n else ():
        # The run of TEXT's words in order ending at text[-1], aligned with q.
        run = 1
        while run < n and text[n - 1 - run] == _WORDS[(q - run) % _LEN]:
            run += 1
        for i in range(run, best, -1):
            first = (q - i + 1) % _LEN
            if first in _IS_START and start_of(text, n - i, salt) == first:
                best = i
                break
    return best
