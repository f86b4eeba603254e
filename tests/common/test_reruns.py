"""The suite's one rerun (tests/conftest.py): e2e and slow tests get it, the fast tier does not, and a
test that fails both runs fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

TESTS = textwrap.dedent(
    """
    import pathlib

    import pytest

    def fails_first(name: str) -> None:
        seen = pathlib.Path(__file__).with_name(name + ".seen")
        if not seen.exists():
            seen.write_text("1")
            raise AssertionError(name + ": the first run fails")

    @pytest.mark.e2e
    def test_e2e_once() -> None:
        fails_first("e2e")

    @pytest.mark.slow
    def test_slow_once() -> None:
        fails_first("slow")

    def test_fast_once() -> None:
        fails_first("fast")

    @pytest.mark.e2e
    def test_e2e_always() -> None:
        raise AssertionError("broken for good")

    @pytest.mark.e2e
    def test_e2e_rerun_gets_a_prefix_of_its_own(prefix: str) -> None:
        seen = pathlib.Path(__file__).with_name("prefix.seen")
        if not seen.exists():
            seen.write_text(prefix)
            raise AssertionError("prefix: the first run fails")
        assert prefix != seen.read_text(), "the rerun shares the first run's subjects and buckets"
    """
)


def test_e2e_and_slow_tests_are_rerun_once_and_the_fast_tier_is_not(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import prefix, pytest_collection_modifyitems, pytest_terminal_summary  # noqa: F401\n"
    )
    (tmp_path / "test_flaky_kinds.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_TEST_RERUNS"}
    got = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-rfR", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = got.stdout
    assert got.returncode == 1, out + got.stderr
    # Passed on their rerun: the e2e and the slow test, and the rerun that got a new prefix. Failed: the
    # fast one (no rerun) and the e2e test that fails every time (after its one rerun).
    assert "2 failed, 3 passed" in out and "4 rerun" in out, out
    assert "FAILED" in out and "test_fast_once" in out and "test_e2e_always" in out, out
    # Each rerun's first failure is shown, not only its name.
    why = out.split("why each rerun test failed its first run", 1)
    assert len(why) == 2 and "e2e: the first run fails" in why[1] and "slow: the first run fails" in why[1], (
        out
    )
