"""The command lines the agent's vLLM adapter builds, parsed by vLLM 0.32's own argparse.

Cheap (no engine is started), so every form is checked: the api_server module on CPU (chat and
pooling, and with LoRA), ``vllm serve`` on GPUs, and a multi-node leader and headless follower. A flag vLLM does not
know is refused, so the check can fail. That the CPU argv also starts and serves: tests/vllm's cluster.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from llmgw_agent.engines import LaunchSpec, launch_spec
from llmgw_agent.settings import AgentSettings
from llmgw_common.messages import ShardAssignment
from tests.vllm.vllm_kit import BASE_ARGS, VllmInstall

pytestmark = [pytest.mark.xdist_group("vllm")]

CHECKER = __file__.replace("test_vllm_argv.py", "argv_check.py")


def _args(install: VllmInstall, a: ShardAssignment, vllm: str) -> list[str]:
    s = launch_spec(a, AgentSettings(node="n", vllm=vllm, model_dirs=[str(install.root / "models")]))
    assert isinstance(s, LaunchSpec), s
    head = len(vllm.split())
    return list(s.argv[head:])


@pytest.mark.slow
def test_vllm_accepts_every_argv_the_adapter_builds(vllm_install: VllmInstall) -> None:
    module = vllm_install.command_line
    cpu = {"device": "cpu"}
    cases = {
        "cpu chat": _args(
            vllm_install,
            ShardAssignment(replica_id="r", shard=0, model="gemma", engine="vllm", port=20001, weights="gemma-3-270m",
                            args=BASE_ARGS, options=cpu),
            module,
        ),
        "cpu pooling": _args(
            vllm_install,
            ShardAssignment(replica_id="r", shard=0, model="e", engine="vllm", port=20002, weights="all-minilm-l6-v2",
                            args=("--runner", "pooling", "--max-model-len", "256"), options=cpu),
            module,
        ),
        "gpu serve": _args(
            vllm_install,
            ShardAssignment(replica_id="r", shard=0, model="g", engine="vllm", port=20003, gpus=(0, 1)),
            "vllm",
        ),
        "leader": _args(
            vllm_install,
            ShardAssignment(replica_id="r", shard=0, shards=2, model="g", engine="vllm", port=20004, gpus=(0,),
                            leader="10.0.0.5:20004"),
            "vllm",
        ),
        # LoRA (issue 33): rank 4 is rounded up to 8, a rank vLLM takes; max_cpu_loras beside it.
        "cpu lora": _args(
            vllm_install,
            ShardAssignment(replica_id="r", shard=0, model="gemma", engine="vllm", port=20006, weights="gemma-3-270m",
                            args=BASE_ARGS, options=cpu, max_loras=2, max_lora_rank=4, max_cpu_loras=4),
            module,
        ),
        "follower": _args(
            vllm_install,
            ShardAssignment(replica_id="r", shard=1, shards=2, model="g", engine="vllm", port=20005, gpus=(0,),
                            leader="10.0.0.5:20004"),
            "vllm",
        ),
    }  # fmt: skip
    assert cases["cpu chat"][:2] == ["--model", str(vllm_install.gemma)]
    assert cases["follower"][0] == "serve" and "--headless" in cases["follower"]
    assert "--enable-lora" in cases["cpu lora"] and "--max-lora-rank" in cases["cpu lora"]
    bad = [*cases["cpu chat"], "--no-such-flag"]
    out = subprocess.run(
        [str(vllm_install.python), CHECKER],
        input=json.dumps([*cases.values(), bad]),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    verdicts = json.loads(out.stdout.strip().splitlines()[-1])
    got = dict(zip([*cases, "bad"], verdicts, strict=True))
    assert {k: v for k, v in got.items() if k != "bad"} == dict.fromkeys(cases), got
    assert got["bad"] and "no-such-flag" in got["bad"], got["bad"]
