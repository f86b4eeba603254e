"""Make small LoRA adapters for the converted Gemma 3 270M, for tests of adapters on real vLLM.

Run by ``deploy/vllm/build.sh`` with the vLLM venv's python (it has torch, transformers and ``peft``):

    python deploy/vllm/make_lora.py BASE_DIR OUT_DIR SEED

Nobody fine-tunes here: ``peft`` wraps the base with LoRA on ``q_proj`` and ``v_proj`` at rank 8 and
the adapter's matrices are drawn from a generator seeded with SEED, so the same SEED gives the same
file on every machine (same torch), and two seeds give two adapters that answer differently. peft's
own initialisation leaves B at zero (an adapter that changes nothing): the draw below replaces both A
and B, scaled so that greedy answers visibly differ from the base's while staying words, not noise.
The directory is what vLLM's ``/v1/load_lora_adapter`` and the agent's storage scan take:
``adapter_config.json`` and ``adapter_model.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
# The standard deviation of A's and B's entries. With alpha/rank = 2, a delta of rank 8 from entries
# of 0.05 moves q and v by about a fifth of the base's own projections: greedy text diverges within a
# few tokens and stays readable (0.02 changed nothing in 24 tokens; 0.2 answered noise).
STD = 0.05
BASE_NAME = "gemma-3-270m"


def make(base: Path, out: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=list(TARGETS),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    # Sorted names: the draw order, and so the weights, do not depend on module registration order.
    params = dict(peft_model.named_parameters())
    drawn = 0
    with torch.no_grad():
        for name in sorted(params):
            if ".lora_A." in name or ".lora_B." in name:
                p = params[name]
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * STD)
                drawn += 1
    if drawn == 0:
        raise SystemExit("make_lora: peft made no LoRA matrices (target modules not found)")
    peft_model.save_pretrained(out, safe_serialization=True)
    # The config names the base as the catalog does, not this machine's path (set after saving: peft
    # looks for the base's config under the name it holds while saving).
    config_path = out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = BASE_NAME
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    for want in ("adapter_config.json", "adapter_model.safetensors"):
        if not (out / want).is_file():
            raise SystemExit(f"make_lora: {out} has no {want} after saving")
    print(f"vllm: LoRA adapter (seed {seed}, rank {RANK}, {drawn} matrices) in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: make_lora.py BASE_DIR OUT_DIR SEED")
    make(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
