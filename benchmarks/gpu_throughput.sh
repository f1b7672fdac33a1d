#!/usr/bin/env bash
# Training throughput on one GPU, no network, in about 4 minutes: SFT, DPO and GRPO (train_ppo, HF rollout engine;
# vLLM when installed) on random-initialised Qwen2.5-0.5B- and 1.5B-shaped models (config only, nothing downloaded)
# and synthetic rows of one length, each as a user runs it (torchrun, one rank, ZeRO-2, packing, a dynamic token
# budget, bf16), plus a plain-PyTorch floor of the SFT step on the same batches (benchmarks/sft_floor.py).
#   bash benchmarks/gpu_throughput.sh        # from anywhere; prints a table and one JSON summary (the last line)
# The summary is also written to $THROUGHPUT_JSON (default $OUT/gpu_throughput.json when $OUT is set, else
# ./gpu_throughput.json). Per job and shape: tokens/s, TFLOP/s per rank and MFU (the perf/* metrics every job logs,
# means over the steps after the first), per-stage TFLOP/s and seconds, generated tokens/s, and for SFT the ratio
# ours / floor of tokens/s (the floor processes the same tokens: compare `tokens_per_step`).
#
# Wheels: as benchmarks/gpu_smoke.sh (its header has the `pip download` lines that fill benchmarks/wheelhouse):
# DeepSpeed (sdist), hjson and pydantic are installed from $WHEELHOUSE with `pip install --no-index` when DeepSpeed is
# not importable, then this checkout with `pip install --no-deps -e .`. No vLLM wheel fits a transfer: the vLLM GRPO
# row runs only where vLLM is already installed.
#
# Environment (defaults on CUDA / on CPU):
#   DEVICE cuda|cpu; PLAN "shape:job,job shape:job" (on CUDA, most wanted first: 1.5b SFT and its floor, 0.5b GRPO,
#   0.5b SFT, floor and DPO, vLLM GRPO, 1.5b DPO and GRPO), or SHAPES ("0.5b 1.5b" / "tiny") x JOBS ("sft floor dpo
#   grpo"; also grpo_vllm, and sft_prof / floor_prof: the job again with its last step under torch.profiler, whose
#   summary (benchmarks/step_profile.py: device busy share, host reads and syncs, top ops) is the result); ROW_TOKENS (1024 / 64), PROMPT_TOKENS (ROW_TOKENS / 4), STEPS (5 / 3), TRAIN_BATCH_SIZE
#   (32 / 8), TOKENS_PER_MICRO_BATCH (4096 / 4 x ROW_TOKENS), ROLLOUT_PROMPTS (16 / 4), SAMPLES_PER_PROMPT (4),
#   NEW_TOKENS (64 / 8), PEAK_TFLOPS (the device table on CUDA; none on CPU), GRADIENT_CHECKPOINTING (0),
#   BUDGET_S (220 / none: no job starts after it), JOB_TIMEOUT_S (150 / 300), INSTALL (1 / 0).
# On CPU (the test suite): DEVICE=cpu SHAPES=tiny PEAK_TFLOPS=1 bash benchmarks/gpu_throughput.sh  (~1 minute)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEELHOUSE=${WHEELHOUSE:-$ROOT/benchmarks/wheelhouse}
export THROUGHPUT_JSON=${THROUGHPUT_JSON:-${OUT:-.}/gpu_throughput.json}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false

on_cuda=$(python -c 'import torch; print(int(torch.cuda.is_available()))')
DEVICE=${DEVICE:-$([ "$on_cuda" = 1 ] && echo cuda || echo cpu)}
export DEVICE

# The wheel install of gpu_smoke.sh, once: DeepSpeed (and hjson, pydantic) when it does not import, this checkout when
# `rlhf.kernels` does not import from outside it (a CPU venv, a second run: nothing to do).
install_wheels() {
  if ! python -c 'import deepspeed' >/dev/null 2>&1; then
    if [ ! -d "$WHEELHOUSE" ]; then
      echo "[gpu_throughput] no deepspeed and no wheelhouse (see benchmarks/gpu_smoke.sh's header)" >&2
      return 1
    fi
    python -m pip install --no-index --find-links "$WHEELHOUSE" --no-build-isolation --progress-bar off \
      hjson pydantic accelerate peft >&2 || return 1
    DS_BUILD_OPS=0 python -m pip install --no-index --find-links "$WHEELHOUSE" --no-build-isolation \
      --progress-bar off deepspeed >&2 || return 1
  fi
  if ! (cd / && python -c 'import rlhf.kernels') >/dev/null 2>&1; then
    python -m pip install --no-index --no-deps --no-build-isolation --progress-bar off -e "$ROOT" >&2 || return 1
  fi
}

if [ "${INSTALL:-$on_cuda}" = 1 ]; then
  start=$SECONDS
  install_wheels || { echo '{"status": "failed", "reason": "install (see the lines above)"}'; exit 1; }
  echo "[gpu_throughput] install: $((SECONDS - start)) s" >&2
  # the time budget counts from here: the install has had its share of the ~4 minutes
  export BUDGET_S=${BUDGET_S:-$((220 - (SECONDS - start)))}
fi
exec python "$ROOT/benchmarks/gpu_throughput_run.py"
