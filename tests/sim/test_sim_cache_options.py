"""The prefix-cache options of the simulated engine: from a profile's mapping, refused when wrong, and
through the command line the agent builds."""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from llmgw_cli import cmd_sim_engine
from llmgw_common.sim_options import DEFAULT_CACHE_BLOCKS
from llmgw_sim.options import SimOptions

CACHE_FLAGS = {
    "--prefix-caching",
    "--block-size",
    "--prefill-tokens-per-s",
    "--kv-events-endpoint",
    "--kv-events-topic",
}


def test_defaults_keep_the_cache_off_and_the_command_line_as_it_was() -> None:
    o = SimOptions()
    assert not o.caches_prefixes and o.prefill_tokens_per_s is None
    assert not CACHE_FLAGS & set(o.to_argv())


def test_events_imply_the_cache_and_capacity_follows_kv_tokens() -> None:
    o = SimOptions.from_dict({"kv_events_endpoint": "ipc:///run/r1/kv.sock"})
    assert o.caches_prefixes and o.cache_blocks == DEFAULT_CACHE_BLOCKS
    assert SimOptions(prefix_caching=True, kv_tokens=1000, block_size=128).cache_blocks == 7
    o = SimOptions.from_dict({"prefix_caching": "yes", "block_size": "128", "prefill_tokens_per_s": 90})
    assert (o.caches_prefixes, o.block_size, o.prefill_tokens_per_s) == (True, 128, 90.0)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"block_size": 0}, "block_size is 0"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s is 0.0, must be > 0"),
        ({"kv_events_endpoint": "/run/kv.sock"}, "is not a ZMQ endpoint"),
        ({"prefix_caching": True, "kv_tokens": 100, "block_size": 128}, "less than one block of 128"),
    ],
)
def test_bad_cache_options_name_what_is_wrong(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SimOptions.from_dict(options)


def test_cache_options_round_trip_through_the_cli() -> None:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """A group, so that `sim-engine` is a subcommand as in `llmgw`."""

    cmd_sim_engine.register(app)
    opts = SimOptions(
        port=0,
        block_size=128,
        prefill_tokens_per_s=95.5,
        kv_events_endpoint="ipc:///tmp/r/kv.sock",
        kv_events_topic="r1",
        prefix_caching=True,
    )
    argv = opts.to_argv()
    assert CACHE_FLAGS <= set(argv)
    r = CliRunner().invoke(app, ["sim-engine", *argv, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert SimOptions(**json.loads(r.stdout)) == opts
    r = CliRunner().invoke(app, ["sim-engine", "--kv-events-endpoint", "nowhere", "--dry-run"])
    assert r.exit_code == 2 and "is not a ZMQ endpoint" in r.output
