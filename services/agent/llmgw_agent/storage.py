"""Model weights a node can see, and whether they sit on shared or local storage.

Weights are judged by what is on disk, never by a directory's name: an empty directory, a download
still in progress (partial or temporary files, a safetensors index naming absent shards, a truncated
safetensors or GGUF file) is not weights (ARCHITECTURE #5). A LoRA adapter's directory (peft's
``adapter_config.json`` and ``adapter_model.safetensors``) is weights too, named by its directory. Shared versus local comes from the mount
table, parsed by a pure function so it can be tested with fixture text (ARCHITECTURE #6).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw_agent.weight_files import gguf_problem, safetensors_problem
from llmgw_common.messages import StorageReport, WeightsEntry

log = logging.getLogger(__name__)

# Network and cluster filesystems: one copy seen by many nodes.
SHARED_FSTYPES: frozenset[str] = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "ceph-fuse"}
)

# Names a download leaves behind while it runs (wget/curl scripts .part, aria2 .aria2, huggingface_hub
# .incomplete and .lock, browsers .crdownload, generic .tmp/.download/.partial).
PARTIAL_SUFFIXES: tuple[str, ...] = (
    ".part", ".tmp", ".incomplete", ".download", ".lock", ".partial", ".aria2", ".crdownload",
)  # fmt: skip

_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    """The mounts in ``/proc/self/mountinfo`` text, in table order. Malformed lines are skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            mounts.append(Mount(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2])))
        except (ValueError, IndexError):
            continue
    return tuple(mounts)


def read_mounts(path: str = "/proc/self/mountinfo") -> tuple[Mount, ...]:
    """The mount table of this process; () when it cannot be read (then everything counts as local)."""
    try:
        return parse_mountinfo(Path(path).read_text())
    except OSError as e:
        log.warning("cannot read the mount table %s (%s): all weights count as local", path, e)
        return ()


def is_shared_fstype(fstype: str) -> bool:
    """True for network and cluster filesystems, and FUSE mounts of them ('fuse.glusterfs')."""
    if fstype in SHARED_FSTYPES:
        return True
    kind, _, sub = fstype.partition(".")
    return kind in ("fuse", "fuseblk") and sub in SHARED_FSTYPES


def mount_of(path: str, mounts: Sequence[Mount]) -> Mount | None:
    """The mount holding ``path``: the longest mount point that is a whole-component prefix.

    Of two mounts on the same point the later one wins, since it hides the earlier.
    """
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        inside = mp == "/" or path == mp or path.startswith(mp + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def locate(path: str, mounts: Sequence[Mount]) -> tuple[bool, str | None]:
    """(shared, filer id) for a path: shared storage is named by its mount source."""
    m = mount_of(path, mounts)
    if m is not None and is_shared_fstype(m.fstype):
        return True, m.source
    return False, None


def _is_partial_name(name: str) -> bool:
    return name.endswith(PARTIAL_SUFFIXES)


def _is_partial_file(relative: Path) -> bool:
    """True for a file a running download leaves inside a model directory.

    huggingface_hub keeps ``.cache/huggingface/download/<file>.lock`` after a download completes
    (filelock does not delete lock files on Unix), so there only ``.incomplete`` files mean a
    download in progress; anywhere else a ``.lock`` does.
    """
    if relative.parts[:2] == (".cache", "huggingface"):
        return relative.name.endswith(".incomplete")
    return _is_partial_name(relative.name)


def _files(directory: Path) -> list[Path]:
    """Every file under ``directory`` (following no symlinked directories), raising OSError if unreadable."""
    found: list[Path] = []
    for root, dirs, names in os.walk(directory, onerror=_raise):
        # Hidden directories are walked too: huggingface_hub keeps a download's state in
        # .cache/huggingface inside the model directory.
        dirs.sort()
        found.extend(Path(root) / n for n in sorted(names))
    return found


def _raise(e: OSError) -> None:
    raise e


def weights_problem(candidate: Path) -> str | None:
    """Why ``candidate`` (a model directory or a .gguf file) is not usable weights, or None."""
    if candidate.is_file():
        for suffix in PARTIAL_SUFFIXES:
            if candidate.with_name(candidate.name + suffix).exists():
                return f"{candidate.name}: still downloading ({candidate.name + suffix} present)"
        return gguf_problem(candidate)
    try:
        files = _files(candidate)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if not files:
        return "empty"
    partial = [f for f in files if _is_partial_file(f.relative_to(candidate))]
    if partial:
        return f"a download in progress ({partial[0].relative_to(candidate)})"
    top = {f.name: f for f in files if f.parent == candidate}
    ggufs = [f for n, f in top.items() if n.endswith(".gguf")]
    # params.json: Mistral's own layout (consolidated.safetensors), which vLLM also loads.
    if "config.json" not in top and "params.json" not in top:
        if ADAPTER_CONFIG in top:
            return adapter_problem(top)
        if ggufs:
            for g in ggufs:
                problem = gguf_problem(g)
                if problem:
                    return problem
            return None
        return "no config.json (or params.json) and no .gguf file"
    for index_name in _INDEX_FILES:
        if index_name in top:
            return _index_problem(candidate, top[index_name])
    shards = [f for n, f in top.items() if n.endswith(".safetensors") or _is_torch_bin(n)]
    if not shards:
        return "a config but no weight files (.safetensors or .bin)"
    for shard in shards:
        problem = _shard_problem(shard)
        if problem:
            return problem
    return None


# A LoRA adapter as peft saves it and vLLM loads it (issue 33): its config and one weight file, named
# by the directory like a model's weights (the catalog's AdapterProfile.weights).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_problem(top: dict[str, Path]) -> str | None:
    """Why a directory holding ``adapter_config.json`` (its files by name) is not a whole LoRA adapter."""
    try:
        config = json.loads(top[ADAPTER_CONFIG].read_text())
    except OSError as e:
        return f"{ADAPTER_CONFIG}: unreadable ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return f"{ADAPTER_CONFIG}: not JSON"
    if not isinstance(config, dict):
        return f"{ADAPTER_CONFIG}: not a JSON object"
    weights = next((top[n] for n in ADAPTER_WEIGHTS if n in top), None)
    if weights is None:
        return f"a LoRA adapter config but no {' or '.join(ADAPTER_WEIGHTS)}"
    return _shard_problem(weights)


def _is_torch_bin(name: str) -> bool:
    # training_args.bin and optimizer states sit next to weights without being weights.
    return name.endswith(".bin") and name not in ("training_args.bin", "optimizer.bin", "scheduler.bin")


def _shard_problem(shard: Path) -> str | None:
    try:
        if shard.stat().st_size == 0:
            return f"{shard.name}: empty"
    except OSError as e:
        return f"{shard.name}: unreadable ({e.strerror or e})"
    if shard.name.endswith(".safetensors"):
        return safetensors_problem(shard)
    return None


def _index_problem(directory: Path, index: Path) -> str | None:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except OSError as e:
        return f"{index.name}: unreadable ({e.strerror or e})"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{index.name}: not a weight index (no weight_map)"
    if not shard_names:
        return f"{index.name}: names no shards"
    for name in shard_names:
        shard = directory / name
        if not shard.is_file():
            return f"{index.name} names {name}, which is absent"
        problem = _shard_problem(shard)
        if problem:
            return problem
    return None


Fingerprint = tuple[tuple[str, int, int, int], ...]


def fingerprint(candidate: Path) -> Fingerprint:
    """What a candidate looks like on disk: each file's relative path, size, mtime and inode.

    Includes a standalone file's partial-download siblings ("m.gguf.part"). Raises OSError.
    """
    if candidate.is_file():
        files = [candidate] + [
            sib for sfx in PARTIAL_SUFFIXES if (sib := candidate.with_name(candidate.name + sfx)).exists()
        ]
        base = candidate.parent
    else:
        files, base = _files(candidate), candidate
    out = []
    for f in files:
        st = f.stat()
        out.append((str(f.relative_to(base)), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


class WeightsCache:
    """Verdicts on candidates, reused while their files look the same (same sizes and mtimes).

    Checking a GGUF walks its whole tokenizer vocabulary; the agent re-collects its inventory every
    few seconds, so it keeps one of these for its life and only changed candidates are re-read.
    """

    def __init__(self) -> None:
        self._verdicts: dict[str, tuple[Fingerprint, str | None]] = {}
        self.checks = 0

    def problem(self, candidate: Path, fp: Fingerprint) -> str | None:
        key = str(candidate)
        hit = self._verdicts.get(key)
        if hit is not None and hit[0] == fp:
            return hit[1]
        self.checks += 1
        verdict = weights_problem(candidate)
        self._verdicts[key] = (fp, verdict)
        return verdict

    def keep_only(self, keys: set[str]) -> None:
        for key in set(self._verdicts) - keys:
            del self._verdicts[key]


def _candidates(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_dir() or (p.is_file() and p.name.endswith(".gguf")))


def scan_model_dirs(
    dirs: Iterable[str], mounts: Sequence[Mount], *, cache: WeightsCache | None = None
) -> StorageReport:
    """What weights the configured directories hold, each marked shared or local.

    No directories configured: ``looked=False``, which is not "looked and found nothing" (#4).
    Candidates are each immediate subdirectory and each standalone .gguf file, named by their
    directory or file name (without ".gguf"); a candidate that is not complete weights is left out
    (logged at debug). ``cache`` keeps verdicts between scans of unchanged candidates.
    """
    dirs = list(dirs)
    if not dirs:
        return StorageReport(looked=False)
    cache = cache if cache is not None else WeightsCache()
    weights: list[WeightsEntry] = []
    problems: list[str] = []
    seen: set[str] = set()
    for d in dirs:
        directory = Path(d)
        try:
            candidates = _candidates(directory)
        except OSError as e:
            problems.append(f"{d}: {e.strerror or e}")
            continue
        for c in candidates:
            try:
                fp = fingerprint(c)
            except OSError as e:
                # Unreadable, or a symlink into nothing (a snapshot whose blob is gone): not
                # weights, and worth an operator's look.
                problems.append(f"{c}: {e.strerror or e}")
                continue
            seen.add(str(c))
            problem = cache.problem(c, fp)
            if problem:
                log.debug("%s is not weights: %s", c, problem)
                continue
            shared, filer = locate(os.path.realpath(c), mounts)
            is_gguf_file = c.name.endswith(".gguf") and c.is_file()
            weights.append(
                WeightsEntry(
                    name=c.name[: -len(".gguf")] if is_gguf_file else c.name,
                    path=str(c),
                    shared=shared,
                    filer_id=filer,
                    # The weight file itself for a GGUF; everything in the directory otherwise.
                    size_bytes=fp[0][1] if is_gguf_file else sum(f[1] for f in fp),
                )
            )
    cache.keep_only(seen)
    return StorageReport(looked=True, weights=tuple(weights), problems=tuple(problems))
