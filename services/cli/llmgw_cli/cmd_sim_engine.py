"""``llmgw sim-engine``: the simulated OpenAI-compatible engine, as its own process."""

from __future__ import annotations

import asyncio
import json
import sys

import typer

from llmgw_common.sim_options import METRICS_STYLES, SimOptions

_D = SimOptions()


def sim_engine(
    port: int = typer.Option(_D.port, help="Port to listen on (0: any free port, printed on stdout)"),
    host: str = typer.Option(_D.host, help="Address to listen on"),
    model: str = typer.Option(_D.model, help="Model name served; other names get a 404"),
    metrics_style: str = typer.Option(
        _D.metrics_style, help=f"Metric names of /metrics: {' or '.join(METRICS_STYLES)}"
    ),
    ttft_ms: float = typer.Option(_D.ttft_ms, help="Time to first token, milliseconds"),
    tokens_per_s: float = typer.Option(_D.tokens_per_s, help="Generation speed of one request, tokens/s"),
    slots: int = typer.Option(_D.slots, help="Requests generated at once; later ones wait in a queue"),
    kv_tokens: int | None = typer.Option(
        None, help="KV-cache capacity in tokens (unset: KV use is the share of slots taken)"
    ),
    startup_s: float = typer.Option(_D.startup_s, help="Simulated model loading: /health is 503 this long"),
    fail_health: bool = typer.Option(False, "--fail-health", help="Fault: /health always answers 503"),
    exit_after: int | None = typer.Option(
        None, help="Fault: exit with code 3 after this many completed requests"
    ),
    rank: int = typer.Option(_D.rank, help="This node's rank in a multi-node replica (0: the leader)"),
    world: int = typer.Option(_D.world, help="Nodes in the replica"),
    leader: str | None = typer.Option(None, help="host:port of rank 0 (followers)"),
    embedding_dims: int = typer.Option(_D.embedding_dims, help="Size of /v1/embeddings vectors"),
    zero: bool = typer.Option(False, "--zero", help="No delay at all (benchmarks)"),
    default_max_tokens: int = typer.Option(
        _D.default_max_tokens, help="Completion length when a request gives no max_tokens"
    ),
    heartbeat_s: float = typer.Option(_D.heartbeat_s, help="Follower heartbeat period, seconds"),
    runner: str | None = typer.Option(
        None, help="Act as vLLM's 'generate' or 'pooling' runner: only its routes (unset: every route)"
    ),
    pooling_task: str = typer.Option(_D.pooling_task, help="A pooling runner's task: embed or classify"),
    num_labels: int = typer.Option(_D.num_labels, help="Labels of a classify model"),
    transcription: bool = typer.Option(
        False, "--transcription", help="A generate runner that also serves /v1/audio (Whisper-like)"
    ),
    responses_store: int = typer.Option(
        _D.responses_store, help="Stored responses kept (an LRU); 0: none, as vLLM without its store"
    ),
    max_model_len: int = typer.Option(_D.max_model_len, help="Context length; longer prompts get 400"),
    prefix_caching: bool = typer.Option(
        False, "--prefix-caching", help="Keep a prefix cache of KV blocks (vLLM's --enable-prefix-caching)"
    ),
    block_size: int = typer.Option(_D.block_size, help="Tokens per KV block (vLLM: 16 on GPUs, 128 on CPU)"),
    prefill_tokens_per_s: float | None = typer.Option(
        None, help="Prefill speed: TTFT grows by uncached prompt tokens / this (unset: ttft_ms alone)"
    ),
    kv_events_endpoint: str | None = typer.Option(
        None, help="Bind a ZMQ PUB socket here and publish vLLM's KV events (implies --prefix-caching)"
    ),
    kv_events_topic: str = typer.Option(_D.kv_events_topic, help="Topic of the KV-event messages"),
    max_loras: int | None = typer.Option(
        None, help="Serve LoRA adapters loaded at run time, at most this many in one batch (unset: no LoRA)"
    ),
    max_lora_rank: int = typer.Option(
        _D.max_lora_rank, help="Largest adapter rank (with --lora-check-files)"
    ),
    max_cpu_loras: int | None = typer.Option(None, help="Adapters held in memory (unset: max-loras)"),
    lora_load_s: float = typer.Option(_D.lora_load_s, help="Seconds one adapter load takes"),
    lora_check_files: bool = typer.Option(
        False, "--lora-check-files", help="Read adapter directories as vLLM does (else any path loads)"
    ),
    log_level: str = typer.Option("INFO", help="Python log level"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved options as JSON and exit"),
) -> None:
    """Run a simulated OpenAI-compatible engine with vLLM- or llama.cpp-style metrics."""
    try:
        opts = SimOptions(
            port=port,
            host=host,
            model=model,
            metrics_style=metrics_style,
            ttft_ms=ttft_ms,
            tokens_per_s=tokens_per_s,
            slots=slots,
            kv_tokens=kv_tokens,
            startup_s=startup_s,
            fail_health=fail_health,
            exit_after=exit_after,
            rank=rank,
            world=world,
            leader=leader,
            embedding_dims=embedding_dims,
            zero=zero,
            default_max_tokens=default_max_tokens,
            heartbeat_s=heartbeat_s,
            runner=runner,
            pooling_task=pooling_task,
            num_labels=num_labels,
            transcription=transcription,
            responses_store=responses_store,
            max_model_len=max_model_len,
            prefix_caching=prefix_caching,
            block_size=block_size,
            prefill_tokens_per_s=prefill_tokens_per_s,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_topic=kv_events_topic,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            lora_load_s=lora_load_s,
            lora_check_files=lora_check_files,
        )
    except ValueError as e:
        typer.echo(f"llmgw sim-engine: {e}", err=True)
        raise typer.Exit(2) from None
    if dry_run:
        typer.echo(json.dumps(opts.to_dict(), sort_keys=True))
        return

    from llmgw_runtime.runtime import run_service, setup_logging
    from llmgw_sim.engine import FaultExit
    from llmgw_sim.serving import serve

    setup_logging(log_level, name="sim-engine")
    exit_code = 0

    async def main(stop: asyncio.Event) -> None:
        nonlocal exit_code
        try:
            await serve(opts, stop)
        except FaultExit as e:
            exit_code = e.code
        except OSError as e:
            # Typically the port is taken: say which.
            typer.echo(f"llmgw sim-engine: cannot listen on {opts.host}:{opts.port}: {e}", err=True)
            exit_code = 1

    run_service(main)
    sys.stdout.flush()
    if exit_code:
        raise typer.Exit(exit_code)


def register(app: typer.Typer) -> None:
    app.command("sim-engine")(sim_engine)
