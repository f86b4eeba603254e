"""W3C traceparent/tracestate as the router reads them: anything it would not forward is None (a new
trace starts), and what it forwards is made anew."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_common.traceparent import (
    MAX_TRACEPARENT,
    TraceParent,
    canonical_traceparent,
    clean_tracestate,
    format_traceparent,
    header_lines,
    parse_traceparent,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{SPAN}-01"


def test_a_valid_traceparent_is_read() -> None:
    p = parse_traceparent(GOOD)
    assert p == TraceParent(int(TRACE, 16), int(SPAN, 16), 1)
    assert p is not None and p.sampled
    assert format_traceparent(*p) == GOOD


def test_an_unsampled_one_keeps_its_flag() -> None:
    p = parse_traceparent(f"00-{TRACE}-{SPAN}-00")
    assert p is not None and not p.sampled


def test_surrounding_blanks_are_optional_whitespace() -> None:
    assert parse_traceparent(f" \t{GOOD} ") == parse_traceparent(GOOD)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        GOOD.upper(),  # upper-case hex is not the format
        f"00-{TRACE.upper()}-{SPAN}-01",
        f"00-{TRACE}-{SPAN.upper()}-01",
        f"00-{TRACE}-{SPAN}-0A",
        f"ff-{TRACE}-{SPAN}-01",  # version ff is forbidden
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 is exactly 55 characters
        f"00-{TRACE}-{SPAN}-01x",
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
        f"00-{TRACE}-{SPAN[:-1]}-01",
        f"00_{TRACE}_{SPAN}_01",
        f"0-{TRACE}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-1",
        f"00-{TRACE}g-{SPAN}-01"[:55],
        f"01-{TRACE}-{SPAN}-01x",  # a later version may be longer, but only after a '-'
        f"00-{TRACE}-{SPAN}-01\r\nx-injected: 1",
    ],
)
def test_a_malformed_traceparent_is_none(value: str) -> None:
    assert parse_traceparent(value) is None


def test_none_is_none() -> None:
    assert parse_traceparent(None) is None


def test_an_oversized_traceparent_is_not_read() -> None:
    # A later version may add fields after a '-': valid up to our bound, not beyond it.
    longer = f"01-{TRACE}-{SPAN}-01-" + "a" * 20
    assert parse_traceparent(longer) == TraceParent(int(TRACE, 16), int(SPAN, 16), 1)
    huge = f"01-{TRACE}-{SPAN}-01-" + "a" * MAX_TRACEPARENT
    assert len(huge) > MAX_TRACEPARENT
    assert parse_traceparent(huge) is None


def test_a_later_version_passes_on_only_the_flags_version_00_knows() -> None:
    p = parse_traceparent(f"7f-{TRACE}-{SPAN}-ff")
    assert p is not None and p.flags == 0x03
    assert format_traceparent(*p).startswith("00-")


@given(st.text(max_size=80))
def test_anything_read_is_forwarded_as_version_00_in_lower_case(value: str) -> None:
    p = parse_traceparent(value)
    if p is not None:
        out = format_traceparent(*p)
        assert len(out) == 55 and out == out.lower() and out.startswith("00-")
        assert parse_traceparent(out) == p


def test_tracestate_is_kept_when_it_is_a_list_of_members() -> None:
    assert (
        clean_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7")
        == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    )


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        ",,,",
        "novalue",
        "=value",
        "key=",
        "a=1," * 33,  # more than 32 members
        "a=" + "x" * 600,  # more than 512 characters
        "a=1\r\nx-injected: 1",
        "a=caf\u00e9",
    ],
)
def test_tracestate_is_dropped_otherwise(value: str | None) -> None:
    assert clean_tracestate(value) is None


def test_header_lines_carry_both() -> None:
    p = TraceParent(int(TRACE, 16), int(SPAN, 16), 1)
    assert header_lines(p, None) == f"traceparent: {GOOD}\r\n".encode()
    assert header_lines(p, "a=1") == f"traceparent: {GOOD}\r\ntracestate: a=1\r\n".encode()


@given(st.one_of(st.text(max_size=80), st.sampled_from([GOOD, f"01-{TRACE}-{SPAN}-ff-x", f" {GOOD}\t"])))
def test_the_canonical_header_is_the_parsed_one_formatted(value: str) -> None:
    """What the router forwards with tracing off (no numbers read) is what it would make from the parse."""
    p = parse_traceparent(value)
    assert canonical_traceparent(value) == (None if p is None else format_traceparent(*p))


def test_a_valid_version_00_header_is_forwarded_as_it_is() -> None:
    assert canonical_traceparent(GOOD) == GOOD
    assert header_lines(GOOD, None) == f"traceparent: {GOOD}\r\n".encode()
