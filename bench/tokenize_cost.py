"""Where tokenizing a wholly new 2,000-token chat goes on a router (issue 32's 1 ms goal), step by step.

gemma-3-270m's tokenizer files (``make vllm``), the chats of ``tests/router/cache/test_hf_tokenizer.py``
(a system prompt, four exchanges, a question; every word new to the piece cache). CPU time of the calling
thread, median over the chats; every variant is checked to give the same ids as ``prompt_ids``:

- ``prompt_ids`` cold: the router's whole path (render, pieces, ``tokenizers``), no piece cached;
- the template's rendering alone;
- ``Tokenizer.encode`` of the rendered text (``tokenizers``, the Rust library);
- its normalizer alone (spaces to "▁");
- the BPE model alone: a tokenizer with no normalizer, pre-tokenizer or post-processor on text already
  normalized (what ``tokenizers`` cannot go below);
- the text cut into words where no Gemma token crosses (before a space that follows anything but a space
  or ">": only ">▁</" in its 262,144 tokens holds "▁" after another character), as the pre-tokenizer;
- ``encode_batch_fast`` (no offsets), which starts a thread pool in the router.

    .venv/bin/python bench/tokenize_cost.py
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.router.cache.test_hf_tokenizer import two_thousand_token_chats
from tests.vllm.vllm_kit import GEMMA, install_root
from tokenizers import Tokenizer

from llmgw_router.cache.hf_files import TOKENIZER_FILES
from llmgw_router.cache.hf_tokenizer import HfPromptTokenizer


def median_ms(f: Callable[[Any], object], xs: list[Any]) -> float:
    ts = []
    for x in xs:
        t = time.thread_time()
        f(x)
        ts.append(time.thread_time() - t)
    return statistics.median(ts) * 1e3


def variant(spec: dict[str, Any], **changes: Any) -> Tokenizer:
    return Tokenizer.from_str(json.dumps({**spec, **changes}))


def main() -> None:
    d = install_root() / "models" / GEMMA
    files = {n: (d / n).read_bytes() for n in TOKENIZER_FILES if (d / n).is_file()}
    spec = json.loads(files["tokenizer.json"])
    cold = HfPromptTokenizer(files, cache_chars=0)
    bodies = two_thousand_token_chats(40, seed=3)
    texts = [cold.render_chat(b) or "" for b in bodies]
    ids = [cold.prompt_ids(b) for b in bodies]
    whole = Tokenizer.from_str(files["tokenizer.json"].decode())
    bare = variant(spec, normalizer=None, pre_tokenizer=None, post_processor=None)
    unsafe = sorted(
        {t[i - 1] for t in spec["model"]["vocab"] for i in range(1, len(t)) if t[i] == "▁" != t[i - 1]}
    )
    words = variant(
        spec,
        normalizer=None,
        pre_tokenizer={
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": f"(?<![ {''.join(re.escape(c) for c in unsafe)}]) +"},
                    "behavior": "MergedWithNext",
                    "invert": False,
                },
                {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": False},
            ],
        },
    )
    normalized = [t.replace(" ", "▁") for t in texts]
    for i, t in enumerate(texts):
        assert whole.encode(t, add_special_tokens=False).ids == ids[i]
        assert bare.encode(normalized[i], add_special_tokens=False).ids == ids[i]
        assert words.encode(t, add_special_tokens=False).ids == ids[i]
    rows = [
        ("prompt_ids, cold (the router's path)", lambda b: cold.prompt_ids(b), bodies),
        ("rendering the template", lambda b: cold.render_chat(b), bodies),
        ("tokenizers: encode", lambda t: whole.encode(t, add_special_tokens=False), texts),
        ("tokenizers: the normalizer alone", lambda t: whole.normalizer.normalize_str(t), texts),
        ("tokenizers: the BPE model alone", lambda t: bare.encode(t, add_special_tokens=False), normalized),
        ("tokenizers: cut into words first", lambda t: words.encode(t, add_special_tokens=False), texts),
        (
            "tokenizers: encode_batch_fast",
            lambda t: whole.encode_batch_fast([t], add_special_tokens=False),
            texts,
        ),
    ]
    print(f"command: {' '.join(sys.argv)}")
    print(f"{len(bodies)} chats of {statistics.median(len(i or []) for i in ids):.0f} tokens; CPU ms, median")
    for _ in range(2):
        for name, f, xs in rows:
            print(f"  {name:40s} {median_ms(f, xs):6.3f}")


if __name__ == "__main__":
    main()
