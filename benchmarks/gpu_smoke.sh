#!/usr/bin/env bash
# GPU smoke run: the CUDA paths no CPU test reaches, in at most ~8 minutes on one GPU, with no network.
#   bash benchmarks/gpu_smoke.sh            # from the repository root; prints one JSON summary
# Writes the summary to $SMOKE_JSON (default: $OUT/gpu_smoke.json when $OUT is set, else ./gpu_smoke.json), each
# finished section to gpu_smoke.progress.jsonl and each failed section's last 300 output lines to gpu_smoke.failures.log
# beside it.
#
# Needs the machine's preinstalled torch (+CUDA), transformers, accelerate, peft, ninja, py-cpuinfo and
# msgpack (as a CUDA PyTorch image has them). The rest comes from a wheelhouse that travels with the
# working tree (WHEELHOUSE, default benchmarks/wheelhouse, git-ignored), installed with `pip install
# --no-index --find-links`, then this checkout with `pip install --no-deps -e .`; a section whose packages
# are missing reports "skipped". Fill the wheelhouse (~6 MiB) on a machine with network, for the GPU
# machine's Python (3.12 here):
#   P="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
#   pip download -d benchmarks/wheelhouse --no-deps --only-binary=:all: $P hjson==3.1.0 pydantic==2.14.4 \
#       pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 liger-kernel==0.8.5
#   pip download -d benchmarks/wheelhouse --no-deps --no-binary=:all: deepspeed==0.19.8
# No vLLM (its CUDA wheel does not fit a 64 MiB transfer; train_ppo runs with --rollout_engine hf) and no
# flash-attn package (no prebuilt wheel for every torch/CUDA pair; the built-in flash kernel is used).
#   SMOKE_ONLY="env install gpu_tests"     # run only these sections (the others report "not run")
#
# Sections (each bounded by `timeout`): env, install, gpu-marked tests, the memory plan against measured peaks
# (SFT and PPO), Triton log-prob kernel vs the chunked reference (bf16, vocabulary 152k: time and peak memory),
# DeepSpeed ZeRO-2 and ZeRO-3 offload/reload round trip followed by a forward on the tiny model, Liger on vs off
# log-probs (separate processes), ring attention at 8k tokens (flash blocks, fp32 blocks, varlen kernels), torch's
# flash varlen op as a block kernel, the NCCL+gloo default group, and short train_sft (packed, ZeRO-2; ZeRO-3 with
# --deepcompile), train_ppo
# (GRPO, HF rollout, --deepspeed_enable_sleep) and train_dpo (ZeRO-3, --ref_offload) runs on the embedded data,
# each with rank 0's planned and measured memory peak per stage.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEELHOUSE=${WHEELHOUSE:-$ROOT/benchmarks/wheelhouse}
SMOKE_JSON=${SMOKE_JSON:-${OUT:-.}/gpu_smoke.json}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PROGRESS=${SMOKE_JSON%.json}.progress.jsonl  # one line per finished section, written as they finish
FAILURES=${SMOKE_JSON%.json}.failures.log  # the last 300 lines of each failed section's output, kept beside it
: >"$PROGRESS"
: >"$FAILURES"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false

# run_section NAME SECONDS CMD...: the command's last stdout line (a JSON object) becomes NAME's result;
# a failure records its exit code and the tail of its output instead.
run_section() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${SMOKE_ONLY:-}" ] && [[ " $SMOKE_ONLY " != *" $name "* ]]; then  # SMOKE_ONLY="env install ..."
    echo '{"status": "not run", "reason": "not in SMOKE_ONLY"}' >"$WORK/$name.json"
    return 0
  fi
  local start=$SECONDS
  # through bash -c so the exported shell functions below can be sections too
  timeout "$limit" bash -c '"$@"' _ "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
  local rc=$?
  if [ "$rc" != 0 ]; then
    { echo "===== $name: exit $rc after $((SECONDS - start)) s"; cat "$WORK/$name.out" "$WORK/$name.err" | tail -n 300
    } >>"$FAILURES"
  fi
  WORK_PROGRESS=$PROGRESS python - "$name" "$rc" "$((SECONDS - start))" "$WORK" <<'EOF'
import json, sys
name, rc, secs, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
out = open(f"{work}/{name}.out").read().strip().splitlines()
err = open(f"{work}/{name}.err").read().strip().splitlines()
result = None
if out:
    try:
        result = json.loads(out[-1])
    except ValueError:
        pass
if result is None or rc != 0:
    errors = [line for line in err if "Error" in line or "error:" in line][:12]
    result = {"status": "timeout" if rc == 124 else ("failed" if rc else "no result"), "rc": rc,
              "errors": errors, "tail": (out + err)[-15:], **(result or {})}
result.setdefault("status", "ok")
result["seconds"] = int(secs)
json.dump(result, open(f"{work}/{name}.json", "w"))
import os
with open(os.environ["WORK_PROGRESS"], "a") as progress:  # kept as it goes: a run cut short still reports
    progress.write(json.dumps({"section": name, **result}) + "\n")
print(f"[gpu_smoke] {name}: {result['status']} ({secs} s)", file=sys.stderr)
EOF
}

CHECKS="$WORK/checks.py"
cat >"$CHECKS" <<'EOF'
"""The smoke checks; `python checks.py SECTION [ARGS]` prints one JSON line."""
import importlib.util
import json
import os
import sys
import time

import torch


def emit(**result):
    print(json.dumps(result))


def need(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not torch.cuda.is_available():
        emit(status="skipped", reason="no CUDA")
        sys.exit(0)
    if missing:
        emit(status="skipped", reason="not installed: " + ", ".join(missing))
        sys.exit(0)


def timed(fn, repeats=3):
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**20


def env():
    import transformers

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                "python": sys.version.split()[0]}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("deepspeed", "liger-kernel", "flash-attn", "triton", "vllm", "accelerate", "peft"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    emit(gpu=gpu, versions=versions)


def logprobs():
    need("triton")
    from rlhf.kernels import chunked_logprobs_entropy
    from rlhf.kernels.logprobs_triton import fused_logprobs_entropy

    N, V = 4096, 152064
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(N, V, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    weights = torch.randn(N, device="cuda", generator=g)
    results = {}
    for name, fn in (("chunked", chunked_logprobs_entropy), ("triton", fused_logprobs_entropy)):
        def step():
            logits.grad = None
            lp, ent = fn(logits, targets)
            ((lp + 0.1 * ent) * weights).sum().backward()
            return lp, ent
        ms, peak = timed(step)
        lp, ent = step()
        results[name] = {"ms_fwd_bwd": round(ms, 2), "peak_mib": round(peak, 1), "lp": lp.detach(),
                         "ent": ent.detach(), "grad": logits.grad.float()}
    ref, tri = results["chunked"], results["triton"]
    emit(rows=N, vocab=V, dtype="bf16",
         max_abs_diff={k: float((ref[k] - tri[k]).abs().max()) for k in ("lp", "ent", "grad")},
         **{name: {k: v for k, v in r.items() if k in ("ms_fwd_bwd", "peak_mib")} for name, r in results.items()})


def deepspeed_offload():
    need("deepspeed", "accelerate")
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.distributed.launch_env import init_distributed, read_launch_env
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm

    device = init_distributed(read_launch_env())
    out = {}
    for stage in (2, 3):
        model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, torch.bfloat16, "sdpa"),
                               EngineConfig(zero_stage=stage), OptimConfig(lr_warmup_ratio=0.0,
                                                                           lr_scheduler="constant"),
                               learning_rate=1e-3, bf16=True, micro_batch_size=2, grad_accum_steps=1,
                               num_optimizer_steps=4, device=device, dp_group=dist.group.WORLD)
        ids = torch.randint(3, model.module.config.vocab_size, (2, 64), device=device)

        def train():
            model.train()
            model.backward(model.engine(input_ids=ids).logits.float().logsumexp(-1).mean(), True)
            model.step()

        def forward():
            model.eval()
            with torch.no_grad():
                return model.engine(input_ids=ids).logits.float()

        train()
        before, allocated = forward(), torch.cuda.memory_allocated()
        model.offload()
        offloaded_mib = (allocated - torch.cuda.memory_allocated()) / 2**20
        during = forward()  # the next step's experience forward runs while the states are on the host
        model.reload(device)
        train()
        steps = [s["step"].device.type for s in model.engine.optimizer.optimizer.state.values() if "step" in s]
        out[f"zero{stage}"] = {"offloaded_mib": round(offloaded_mib, 2),
                               "forward_max_diff": float((before - during).abs().max()),
                               "finite_after_reload": bool(torch.isfinite(forward()).all()),
                               "adam_step_devices": sorted(set(steps))}
    emit(**out)


def liger(enabled, path):
    need("liger_kernel", "triton")
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.models.loading import apply_liger_kernel, load_causal_lm
    from rlhf.models.lm_logprobs import policy_forward

    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.bfloat16, "sdpa").cuda()
    if enabled == "1":
        apply_liger_kernel(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (4, 128), generator=g).cuda()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        lp = policy_forward(model, ids, mask).logprobs_BT1.float().cpu()
    torch.save(lp, path)
    emit(liger=enabled == "1")


def liger_compare(off_path, on_path):
    if not (os.path.exists(off_path) and os.path.exists(on_path)):
        emit(status="skipped", reason="one of the runs produced no log-probs")
        return
    off, on = torch.load(off_path), torch.load(on_path)
    emit(max_abs_diff=float((off - on).abs().max()), mean_abs_diff=float((off - on).abs().mean()))


def ring():
    need()
    from rlhf.kernels import cu_seqlens_from_lengths, ring_attention, varlen_attention
    from rlhf.kernels.ring_attention import block_kernel_for
    from rlhf.kernels.varlen_attention import varlen_backend_for

    lengths, H, K, D = [4096, 2048, 1024, 1024], 16, 4, 128
    cu = cu_seqlens_from_lengths(lengths).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (H, K, K))
    results = {}
    runs = (("ring_1_rank_" + block_kernel_for(q).name.split()[0], lambda: ring_attention(q, k, v, cu, None)),
            ("ring_1_rank_einsum", lambda: ring_attention(q, k, v, cu, None, block_kernel="einsum")),
            ("varlen_" + varlen_backend_for(q), lambda: varlen_attention(q, k, v, cu, max(lengths))),
            ("varlen_sdpa", lambda: varlen_attention(q, k, v, cu, max(lengths), backend="sdpa")))
    for name, fn in runs:
        def step():
            q.grad = k.grad = v.grad = None
            out = fn()
            out.float().square().sum().backward()
            return out, q.grad.float(), k.grad.float(), v.grad.float()
        ms, peak = timed(step)
        results[name] = {"ms_fwd_bwd": round(ms, 2), "peak_mib": round(peak, 1), "out": step()}
    base = results["varlen_sdpa"]["out"]
    emit(tokens=sum(lengths), heads=[H, K, D],
         **{n: {"ms_fwd_bwd": r["ms_fwd_bwd"], "peak_mib": r["peak_mib"],
                "max_abs_diff_vs_sdpa": [float((a.float() - b.float()).abs().max()) for a, b in zip(r["out"], base)]}
            for n, r in results.items()})


def flash_blocks():
    """PyTorch's built-in FlashAttention-2 varlen op as a ring block kernel: output and log-sum-exp against a
    fp32 reference, and the ring's backward (each block given the FINAL output and lse) summed over two key
    blocks against autograd through the whole row."""
    need()
    aten = torch.ops.aten
    lengths, H, D = [300, 128, 77], 8, 64
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    T, scale = sum(lengths), D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(T, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))

    def reference(causal):
        qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
        outs, lses = [], []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            scores = torch.einsum("nhd,mhd->hnm", qf[s:e], kf[s:e]) * scale
            if causal:
                scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool, device="cuda").triu(1), -1e30)
            lses.append(scores.logsumexp(-1))
            outs.append(torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vf[s:e]))
        out = torch.cat(outs)
        grads = torch.autograd.grad((out * dout.float()).sum(), (qf, kf, vf))
        return out.detach(), torch.cat(lses, dim=1).detach(), grads

    result = {"torch": torch.__version__}
    try:
        _flash_blocks_checks(result, q, k, v, dout, cu, lengths, H, scale, reference)
    except Exception as error:  # report what was learnt before the failure
        result.update(status="failed", error=f"{type(error).__name__}: {error}"[:800])
    emit(**result)


def _flash_blocks_checks(result, q, k, v, dout, cu, lengths, H, scale, reference):
    aten = torch.ops.aten
    T = sum(lengths)
    M = max(lengths)
    for causal in (True, False):
        out, lse, seed, offset, _ = aten._flash_attention_forward(q, k, v, cu, cu, M, M, 0.0, causal, False,
                                                                    scale=scale)
        ref_out, ref_lse, ref_grads = reference(causal)
        dq, dk, dv = aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, M, M, 0.0, causal, seed, offset,
                                                     scale=scale)
        result["causal" if causal else "full"] = {
            "lse_shape": list(lse.shape), "lse_dtype": str(lse.dtype),
            "out_max_diff": float((out.float() - ref_out).abs().max()),
            "lse_max_diff": float((lse.float().reshape(H, -1)[:, :T] - ref_lse).abs().max()),
            "grad_max_diff": [float((a.float() - b).abs().max()) for a, b in zip((dq, dk, dv), ref_grads)]}
    # two key blocks (first 150 / the rest of the first sequence, as a ring splits it), merged by lse, then each
    # block's backward with the final out and lse
    s0 = lengths[0]
    q0, k0, v0, d0 = q[:s0], k[:s0], v[:s0], dout[:s0]
    ref_out, ref_lse, ref_grads = None, None, None
    qf, kf, vf = (t.float().requires_grad_() for t in (q0, k0, v0))
    scores = torch.einsum("nhd,mhd->hnm", qf, kf) * scale
    full = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, -1), vf)  # non-causal
    ref_grads = torch.autograd.grad((full * d0.float()).sum(), (qf, kf, vf))
    c = lambda n: torch.tensor([0, n], device="cuda", dtype=torch.int32)
    blocks = [(0, 150), (150, s0)]
    parts = [aten._flash_attention_forward(q0, k0[a:b], v0[a:b], c(s0), c(b - a), s0, b - a, 0.0, False, False,
                                           scale=scale) for a, b in blocks]
    lses = torch.stack([p[1].float().reshape(H, -1)[:, :s0] for p in parts])
    final_lse = torch.logsumexp(lses, 0)
    final_out = sum(p[0].float() * torch.exp(l - final_lse).T[..., None] for p, l in zip(parts, lses))
    dq = torch.zeros_like(q0, dtype=torch.float32)
    dks, dvs = [], []
    for (a, b), p in zip(blocks, parts):
        gq, gk, gv = aten._flash_attention_backward(d0, q0, k0[a:b], v0[a:b], final_out.to(q0.dtype),
                                                    final_lse.reshape(p[1].shape).to(p[1].dtype), c(s0), c(b - a),
                                                    s0, b - a, 0.0, False, p[2], p[3], scale=scale)
        dq += gq.float()
        dks.append(gk.float())
        dvs.append(gv.float())
    result["two_blocks"] = {"out_max_diff": float((final_out - full.detach()).abs().max()),
                            "grad_max_diff": [float((a - b).abs().max()) for a, b in
                                              zip((dq, torch.cat(dks), torch.cat(dvs)), ref_grads)]}


def nccl_gloo():
    need()
    import torch.distributed as dist

    from rlhf.distributed.launch_env import init_distributed, read_launch_env

    device = init_distributed(read_launch_env())
    on_gpu, on_host = torch.ones(4, device=device), torch.ones(4)
    dist.all_reduce(on_gpu)
    dist.all_reduce(on_host)
    sub = dist.new_group([0])
    dist.broadcast(on_gpu, src=0, group=sub)
    emit(backend=str(dist.get_backend()), device=str(device), cuda_sum=float(on_gpu.sum()),
         cpu_sum=float(on_host.sum()), local_world_size=os.environ.get("LOCAL_WORLD_SIZE"))
    dist.destroy_process_group()


if __name__ == "__main__":
    section, *args = sys.argv[1:]
    {"env": env, "logprobs": logprobs, "deepspeed": deepspeed_offload, "liger": liger,
     "liger_compare": liger_compare, "ring": ring, "flash_blocks": flash_blocks, "nccl_gloo": nccl_gloo}[section](*args)
EOF

torchrun1() {  # one rank on this GPU, a free port
  local port
  port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python -m torch.distributed.run --nproc_per_node 1 --master_addr 127.0.0.1 --master_port "$port" "$@"
}

install_wheels() {
  if [ ! -d "$WHEELHOUSE" ]; then
    echo '{"status": "skipped", "reason": "no wheelhouse (see the header of benchmarks/gpu_smoke.sh)"}'
    return 0
  fi
  # accelerate, peft, ninja, py-cpuinfo and msgpack are usually preinstalled with torch; pip resolves what
  # is missing from the wheelhouse and leaves what is there.
  python -m pip install --no-index --find-links "$WHEELHOUSE" --no-build-isolation --progress-bar off \
    hjson pydantic accelerate peft 'liger-kernel>=0.8' >&2 || return 1
  DS_BUILD_OPS=0 python -m pip install --no-index --find-links "$WHEELHOUSE" --no-build-isolation \
    --progress-bar off deepspeed >&2 || return 1
  # this checkout, as users install it (rlhf.kernels maps to kernels/); its dependencies are resolved above
  python -m pip install --no-index --no-deps --no-build-isolation --progress-bar off -e "$ROOT" >&2 || return 1
  python - <<'PY'
import json
from importlib.metadata import version
print(json.dumps({"installed": {n: version(n) for n in ("deepspeed", "liger-kernel", "pydantic", "hjson")}}))
PY
}

gpu_tests() {
  python -m pytest -q -p no:cacheprovider --junitxml "$WORK/junit.xml" tests/gpu \
    --ignore tests/gpu/test_memory_plan_cuda.py >&2  # its own section: memory_plan
  python - "$WORK/junit.xml" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root[0]
failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
          if c.find("failure") is not None or c.find("error") is not None]
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
print(json.dumps({"status": "failed" if failed else "ok", **counts, "failed": failed}))
EOF
}

# The memory plan against max_memory_allocated (tests/gpu/test_memory_plan_cuda.py): SFT and PPO, bf16, ZeRO-2,
# packed, each stage's planned and measured MiB on rank 0; fails past 25%.
memory_plan() {
  python -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu/test_memory_plan_cuda.py >"$WORK/memory_plan.log" 2>&1
  local rc=$?
  cat "$WORK/memory_plan.log" >&2
  python - "$WORK/memory_plan.log" "$rc" <<'PY'
import json, sys
lines = [line for line in open(sys.argv[1]) if line.startswith("MEMORY_PLAN ")]
table = json.loads(lines[-1][len("MEMORY_PLAN "):]) if lines else None
status = "failed" if sys.argv[2] != "0" else ("ok" if table else "skipped")  # skipped: no CUDA
print(json.dumps({"status": status, "tolerance": 0.25, "rank0": table}))
PY
  return "$rc"
}

# Each job run below also reports rank 0's planned and measured peak per stage (memory_peaks.json beside its
# metrics.jsonl; CUDA's max_memory_allocated), and the ratio.
cat >"$WORK/smoke_peaks.py" <<'EOF'
import json
import os


def planned_vs_measured(metrics_path: str) -> dict:
    with open(os.path.join(os.path.dirname(metrics_path), "memory_peaks.json")) as f:
        rank0 = json.load(f)["0"]
    return {stage: {"planned_mib": round(v["estimated"] / 2**20, 1), "measured_mib": round(v["measured"] / 2**20, 1),
                    "planned/measured": round(v["estimated"] / v["measured"], 3) if v["measured"] else None}
            for stage, v in rank0.items()}
EOF

# train JOB METRIC FLAGS...: one short run of a CLI job on this GPU (bf16, the embedded model and data); prints
# the held-out METRIC before training and at the end (metrics.jsonl), and the wall time of the run.
train() {
  local job=$1 metric=$2 dir="$WORK/train_$1" n=1
  while [ -e "$dir" ]; do dir="$WORK/train_${job}_$((n++))"; done  # a second run of the same job
  shift 2
  local tiny
  tiny=$(python -c 'from rlhf.assets import TINY_DIR; print(TINY_DIR)')
  torchrun1 -m "rlhf.cli.$job" --pretrain "$tiny/policy" --save_path "$dir" --save_steps -1 --logging_steps 1 \
    --eval_steps -1 --max_epochs 1 --max_len 32 --train_batch_size 32 --micro_train_batch_size 8 \
    --param_dtype bf16 --seed 1 --input_template "{} " "${@//@TINY@/$tiny}" >&2 || return 1
  PYTHONPATH="$WORK" python - "$dir/metrics.jsonl" "$metric" <<'PY'
import json, sys
from smoke_peaks import planned_vs_measured
rows = [json.loads(line) for line in open(sys.argv[1])]
values = [r[sys.argv[2]] for r in rows if sys.argv[2] in r]
print(json.dumps({"metric": sys.argv[2], "first": values[0], "last": values[-1], "logged_rows": len(rows),
                  "memory_plan": planned_vs_measured(sys.argv[1])}))
PY
}

# GRPO through train_ppo on this GPU with HF generation (no vLLM here), every model colocated, the hybrid
# engine's DeepSpeed sleep on: the reward of the first and the last two steps.
grpo() {
  local dir="$WORK/train_grpo" tiny
  tiny=$(python -c 'from rlhf.assets import TINY_DIR; print(TINY_DIR)')
  torchrun1 -m rlhf.cli.train_ppo --pretrain "$tiny/policy" --remote_rm_url "$tiny/reward.py" \
    --prompt_data "$tiny/prompts.jsonl" --input_key input --label_key label --colocate_all_models \
    --rollout_engine hf --deepspeed_enable_sleep --zero_stage 2 --param_dtype bf16 --packing_samples \
    --advantage_estimator group_norm --use_kl_loss --kl_estimator k3 --init_kl_coef 0.001 \
    --n_samples_per_prompt 8 --rollout_batch_size 16 --micro_rollout_batch_size 32 --train_batch_size 64 \
    --micro_train_batch_size 16 --generate_max_len 8 --prompt_max_len 16 --actor_learning_rate 3e-3 \
    --lr_warmup_ratio 0.05 --num_episodes 8 --max_steps 24 --seed 1 --save_path "$dir" >&2 || return 1
  PYTHONPATH="$WORK" python - "$dir/metrics.jsonl" <<'PY'
import json, sys
from smoke_peaks import planned_vs_measured
rewards = [json.loads(line)["reward_mean"] for line in open(sys.argv[1])]
print(json.dumps({"steps": len(rewards), "reward_first_2": sum(rewards[:2]) / 2, "reward_last_2": sum(rewards[-2:]) / 2,
                  "memory_plan": planned_vs_measured(sys.argv[1])}))
PY
}

export ROOT WORK WHEELHOUSE
export -f torchrun1 install_wheels gpu_tests memory_plan train grpo

run_section env 30 python "$CHECKS" env
run_section install 120 install_wheels
run_section gpu_tests 120 gpu_tests
run_section memory_plan 150 memory_plan
run_section logprobs_triton_vs_chunked 60 python "$CHECKS" logprobs
run_section deepspeed_offload_reload 100 torchrun1 "$CHECKS" deepspeed
run_section liger_off 40 python "$CHECKS" liger 0 "$WORK/liger_off.pt"
run_section liger_on 40 python "$CHECKS" liger 1 "$WORK/liger_on.pt"
run_section liger_on_vs_off 20 python "$CHECKS" liger_compare "$WORK/liger_off.pt" "$WORK/liger_on.pt"
run_section ring_attention_8k 60 python "$CHECKS" ring
run_section flash_block_kernel 40 python "$CHECKS" flash_blocks
run_section nccl_gloo_group 40 torchrun1 "$CHECKS" nccl_gloo
run_section train_sft_packed_zero2 120 train train_sft eval_gpt_loss --zero_stage 2 --packing_samples \
  --gradient_checkpointing --learning_rate 3e-3 --lr_warmup_ratio 0.05 --attn_implementation sdpa \
  --dataset @TINY@/sft.jsonl --eval_dataset @TINY@/sft_eval.jsonl --input_key input --output_key output
run_section train_sft_deepcompile_zero3 150 train train_sft eval_gpt_loss --zero_stage 3 --deepcompile \
  --learning_rate 3e-3 --lr_warmup_ratio 0.05 --attn_implementation sdpa \
  --dataset @TINY@/sft.jsonl --eval_dataset @TINY@/sft_eval.jsonl --input_key input --output_key output
run_section train_grpo_hf_rollout_sleep 150 grpo
run_section train_dpo_zero3_offload 120 train train_dpo eval_acc --zero_stage 3 --ref_offload \
  --learning_rate 1e-3 --lr_warmup_ratio 0.05 --beta 0.1 --attn_implementation sdpa \
  --dataset @TINY@/pairs.jsonl --eval_dataset @TINY@/pairs_eval.jsonl --prompt_key prompt --chosen_key chosen \
  --rejected_key rejected

python - "$WORK" "$SMOKE_JSON" <<'EOF'
import json, sys
work, dest = sys.argv[1], sys.argv[2]
names = ["env", "install", "gpu_tests", "memory_plan", "logprobs_triton_vs_chunked", "deepspeed_offload_reload", "liger_off",
         "liger_on", "liger_on_vs_off", "ring_attention_8k", "flash_block_kernel", "nccl_gloo_group", "train_sft_packed_zero2",
         "train_sft_deepcompile_zero3", "train_grpo_hf_rollout_sleep", "train_dpo_zero3_offload"]
summary = {n: json.load(open(f"{work}/{n}.json")) for n in names}
summary["ok"] = all(s.get("status") in ("ok", "skipped", "not run") for s in summary.values())
text = json.dumps(summary, indent=1)
open(dest, "w").write(text + "\n")
print(text)
EOF
