"""The poll helper every test waits with: it returns the value, tolerates only what it is told to,
and its failure says what never happened."""

from __future__ import annotations

import pytest

from tests.kit.poll import eventually, eventually_sync


async def test_eventually_returns_the_first_truthy_value_of_a_sync_or_async_check() -> None:
    calls: list[int] = []

    def sync_check() -> list[int]:
        calls.append(1)
        return calls if len(calls) >= 3 else []

    assert await eventually(sync_check, every=0.001) == [1, 1, 1]

    async def async_check() -> str:
        return "ready"

    assert await eventually(async_check) == "ready"


async def test_eventually_names_what_it_waited_for_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0.05s waiting for the leader \(last: 0\)"):
        await eventually(lambda: 0, timeout=0.05, every=0.01, what="the leader")


async def test_eventually_tolerates_only_the_exceptions_it_is_given() -> None:
    tries: list[int] = []

    def starting() -> bool:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionRefusedError("not yet")
        return True

    assert await eventually(starting, every=0.001, tolerate=(ConnectionRefusedError,)) is True
    with pytest.raises(ZeroDivisionError):
        await eventually(lambda: 1 / 0, tolerate=(ConnectionRefusedError,))

    def refused() -> bool:
        raise ConnectionRefusedError("still starting")

    with pytest.raises(AssertionError, match="last: ConnectionRefusedError"):
        await eventually(refused, timeout=0.01, every=0.001, tolerate=(OSError,))


def test_eventually_sync_returns_or_names_what_never_happened() -> None:
    box = [0]

    def grows() -> int:
        box[0] += 1
        return box[0] if box[0] > 2 else 0

    assert eventually_sync(grows, every=0.001) == 3
    with pytest.raises(AssertionError, match="waiting for a file"):
        eventually_sync(lambda: False, timeout=0.02, every=0.005, what="a file")
