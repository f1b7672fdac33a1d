"""The jobs of `gpu_throughput.sh`: SFT, DPO and GRPO (`train_ppo`, HF rollout engine; vLLM when installed) as a user
runs them (torchrun, one rank, ZeRO-2, packing, a dynamic token budget; bf16 on CUDA) on random-initialised
Qwen2.5-shaped models and synthetic rows of one length, their perf/* metrics read back from metrics.jsonl, and
`sft_floor.py` on the same SFT batches. Prints a table and one JSON summary (the last line), also written to
$THROUGHPUT_JSON. Configured by environment variables (see `Settings.from_env`). Knows the CLI flags and the metric
names; nothing of the trainers' insides.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from gpu_throughput_inputs import SHAPES, build_model_dir, write_rows  # noqa: E402

JOBS = ("sft", "floor", "dpo", "grpo", "grpo_vllm", "sft_prof", "floor_prof")
"""`*_prof`: the job once more with its last step profiled (`step_profile.py`); its result is the profile's summary."""
STAGES = ("generation", "experience", "train", "weight_sync", "step", "other")  # rlhf.core.throughput.STAGES + other
GPU_PLAN = "1.5b:sft,floor 0.5b:grpo,sft,floor,dpo,grpo_vllm 1.5b:dpo,grpo"
"""The default order on CUDA, most wanted first: what the time budget leaves out is reported as not run."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    device: str  # DEVICE: cuda or cpu (default: cuda when available)
    plan: list[tuple[str, str]]  # PLAN "shape:job,job ..." or SHAPES x JOBS, in order
    row_tokens: int  # ROW_TOKENS: tokens of every SFT row and of each side of a DPO pair (EOS included)
    prompt_tokens: int  # PROMPT_TOKENS: the prompt's share of them; also the GRPO prompt length
    steps: int  # STEPS: optimizer steps per job (metrics: means over the steps after the first)
    train_batch_size: int  # TRAIN_BATCH_SIZE: SFT rows / DPO pairs per step
    max_tokens: int  # TOKENS_PER_MICRO_BATCH: --train_max_tokens_per_gpu (and the floor's budget)
    rollout_prompts: int  # ROLLOUT_PROMPTS: GRPO prompts per step
    samples_per_prompt: int  # SAMPLES_PER_PROMPT
    new_tokens: int  # NEW_TOKENS: --generate_max_len
    peak_tflops: float | None  # PEAK_TFLOPS: one device's peak for MFU (default on CUDA: the device table)
    gradient_checkpointing: bool  # GRADIENT_CHECKPOINTING=1
    budget_s: float  # BUDGET_S: stop starting jobs when this much time has gone (default 220 on CUDA)
    job_timeout_s: float  # JOB_TIMEOUT_S: the most one job may take
    out_json: str  # THROUGHPUT_JSON

    @staticmethod
    def from_env(env: dict[str, str]) -> Settings:
        import torch

        device = env.get("DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        gpu = device == "cuda"
        if env.get("PLAN") or not (env.get("SHAPES") or env.get("JOBS") or not gpu):
            plan = parse_plan(env.get("PLAN") or GPU_PLAN)
        else:
            shapes = env.get("SHAPES", "0.5b 1.5b" if gpu else "tiny").split()
            plan = parse_plan(" ".join(f"{s}:{','.join(env.get('JOBS', 'sft floor dpo grpo').split())}"
                                       for s in shapes))
        row = int(env.get("ROW_TOKENS", 1024 if gpu else 64))
        peak = env.get("PEAK_TFLOPS")
        return Settings(device=device, plan=plan, row_tokens=row, prompt_tokens=int(env.get("PROMPT_TOKENS", row // 4)),
                        steps=int(env.get("STEPS", 5 if gpu else 3)),
                        train_batch_size=int(env.get("TRAIN_BATCH_SIZE", 32 if gpu else 8)),
                        max_tokens=int(env.get("TOKENS_PER_MICRO_BATCH", 4096 if gpu else 4 * row)),
                        rollout_prompts=int(env.get("ROLLOUT_PROMPTS", 16 if gpu else 4)),
                        samples_per_prompt=int(env.get("SAMPLES_PER_PROMPT", 4)),
                        new_tokens=int(env.get("NEW_TOKENS", 64 if gpu else 8)),
                        peak_tflops=float(peak) if peak else None,
                        gradient_checkpointing=env.get("GRADIENT_CHECKPOINTING", "0") == "1",
                        budget_s=float(env.get("BUDGET_S", 220 if gpu else 1e9)),
                        job_timeout_s=float(env.get("JOB_TIMEOUT_S", 150 if gpu else 300)),
                        out_json=env.get("THROUGHPUT_JSON") or os.path.join(env.get("OUT", "."), "gpu_throughput.json"))

    @property
    def bf16(self) -> bool:
        return self.device == "cuda"


def parse_plan(text: str) -> list[tuple[str, str]]:
    """"shape:job,job shape:job" -> [(shape, job), ...] in order; an unknown name is a ValueError."""
    plan = []
    for part in text.split():
        shape, _, jobs = part.partition(":")
        plan += [(shape, job) for job in jobs.split(",")]
    for shape, job in plan:
        if shape not in SHAPES or job not in JOBS:
            raise ValueError(f"PLAN/SHAPES/JOBS: unknown {shape}:{job}; shapes {sorted(SHAPES)}, jobs {JOBS}")
    return plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_flags(s: Settings, job: str, model: str, data: dict[str, str]) -> tuple[str, list[str]]:
    """(module, flags) of one CLI job."""
    common = ["--pretrain", model, "--zero_stage", "2", "--param_dtype", "bf16" if s.bf16 else "fp32",
              "--attn_implementation", "sdpa", "--packing_samples", "--use_dynamic_batch",
              "--train_max_tokens_per_gpu", str(s.max_tokens), "--max_steps", str(s.steps), "--save_steps", "-1",
              "--logging_steps", "1", "--seed", "1", "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
              "--perf", *(["--gradient_checkpointing"] if s.gradient_checkpointing else []),
              *(["--peak_tflops", str(s.peak_tflops)] if s.peak_tflops else [])]
    supervised = ["--max_epochs", "1", "--eval_steps", "-1", "--train_batch_size", str(s.train_batch_size),
                  "--micro_train_batch_size", "1", "--max_len", str(s.row_tokens + 8), "--learning_rate", "1e-5"]
    if job == "sft":
        return "train_sft", [*common, *supervised, "--dataset", data["sft"], "--input_key", "input",
                             "--output_key", "output", "--input_template", "{} "]
    if job == "dpo":
        return "train_dpo", [*common, *supervised, "--dataset", data["pairs"], "--prompt_key", "prompt",
                             "--chosen_key", "chosen", "--rejected_key", "rejected", "--beta", "0.1",
                             "--input_template", "{} "]
    from rlhf.assets import TINY_DIR

    samples = s.rollout_prompts * s.samples_per_prompt
    engine = ["--rollout_engine", "vllm", "--vllm_gpu_memory_utilization", "0.3"] if job == "grpo_vllm" else \
        ["--rollout_engine", "hf"]
    return "train_ppo", [*common, *engine, "--remote_rm_url", os.path.join(TINY_DIR, "reward.py"),
                         "--prompt_data", data["prompts"], "--input_key", "input", "--label_key", "label",
                         "--input_template", "{} ", "--colocate_all_models", "--advantage_estimator", "group_norm",
                         "--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", "0.001",
                         "--n_samples_per_prompt", str(s.samples_per_prompt),
                         "--rollout_batch_size", str(s.rollout_prompts), "--micro_rollout_batch_size", str(samples),
                         "--train_batch_size", str(samples), "--micro_train_batch_size", str(samples),
                         "--generate_max_len", str(s.new_tokens), "--prompt_max_len", str(s.prompt_tokens + 8),
                         "--actor_learning_rate", "1e-6", "--num_episodes", "1"]


def run_job(s: Settings, job: str, model: str, data: dict[str, str], out: str, timeout: float) -> dict:
    """One job (or the floor, `sft_floor.py`) in a session of its own; its summary, or its failure and log tail."""
    log_path = out + ".log"
    profile = job.endswith("_prof")  # the job's last step profiled (benchmarks/step_profile.py): its summary only
    job = job.removesuffix("_prof")
    if job == "floor":
        cmd = [sys.executable, os.path.join(HERE, "sft_floor.py"), "--model", model, "--dataset", data["sft"],
               "--max_len", str(s.row_tokens + 8), "--train_batch_size", str(s.train_batch_size),
               "--max_tokens_per_micro_batch", str(s.max_tokens), "--steps", str(s.steps), "--seed", "1",
               "--dtype", "bf16" if s.bf16 else "fp32", "--device", s.device,
               *(["--gradient_checkpointing"] if s.gradient_checkpointing else []),
               *(["--peak_tflops", str(s.peak_tflops)] if s.peak_tflops else []),
               *(["--profile_step", str(s.steps), "--profile_out", out + ".profile.json"] if profile else [])]
    else:
        module, flags = job_flags(s, job, model, data)
        # the tests' preloaded launch server when they set one (tests/launch_server.py): the same rank, forked
        launcher = ["tests.launch_server", "--client"] if os.environ.get("RLHF_TEST_LAUNCH_SOCKET") and not profile \
            else ["torch.distributed.run"]
        target = [os.path.join(HERE, "step_profile.py"), "--step", str(s.steps), "--out", out + ".profile.json",
                  "-m"] if profile else ["-m"]
        cmd = [sys.executable, "-m", *launcher, "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *target, f"rlhf.cli.{module}", *flags, "--save_path", out]
    start = time.perf_counter()
    for _ in range(3):  # a rendezvous port taken between free_port() and torchrun's bind: another port
        code, text = run_logged(cmd, log_path, timeout - (time.perf_counter() - start))
        if code == 0 or "EADDRINUSE" not in text or job == "floor":
            break
        cmd[cmd.index("--master_port") + 1] = str(free_port())
    seconds = round(time.perf_counter() - start, 1)
    if code != 0:
        lines = text.strip().splitlines()
        errors = [line for line in lines if "Error" in line or "error:" in line][:12]  # torchrun's tail hides them
        return {"status": "timeout" if code == "timeout" else "failed", "rc": code, "seconds": seconds,
                "errors": errors, "tail": lines[-12:]}
    if profile:
        with open(out + ".profile.json") as f:
            return {"status": "ok", "seconds": seconds, "profile": json.load(f)}
    result = json.loads(text.strip().splitlines()[-1]) if job == "floor" else job_summary(out)
    return {"status": "ok", "seconds": seconds, **result}


def run_logged(cmd: list[str], log_path: str, timeout: float) -> tuple[int | str, str]:
    """(exit code or "timeout", output) of `cmd` in a session of its own (killed whole on timeout: torchrun's
    workers too)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | str = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
    with open(log_path) as log:
        return code, log.read()


def job_summary(out: str) -> dict:
    """A job's perf/* and time/* metrics, means over the steps after the first (as `--perf` prints them), and
    the trained tokens per step (tokens/s x step seconds, per step)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "time/step" in r]
    timed = rows[1:] or rows
    keys = sorted({k for r in timed for k in r if k.startswith(("perf/", "time/"))})
    means = {k: statistics.fmean(r.get(k, 0.0) for r in timed) for k in keys}
    summary = {"steps": len(rows), "tokens_per_step": [round(r.get("perf/tokens_per_s", 0.0) * r["time/step"], 3)
                                                       for r in rows],
               "time_step_s": means.get("time/step"), "tokens_per_s": means.get("perf/tokens_per_s"),
               "tflops": means.get("perf/tflops"), "mfu": means.get("perf/mfu"),
               "generated_tokens_per_s": means.get("perf/generated_tokens_per_s"),
               "stages": {st: {"tflops": means.get(f"perf/{st}_tflops"), "seconds": means[f"time/{st}"]}
                          for st in STAGES if f"time/{st}" in means and st != "step"}}
    for loss in ("gpt_loss", "loss", "policy_loss"):
        if loss in rows[0]:
            summary["losses"] = [r[loss] for r in rows]
            break
    return summary


def peak_of(s: Settings) -> tuple[float | None, str]:
    import torch

    from rlhf.core.throughput import device_peak_tflops

    return device_peak_tflops(torch.device(s.device), s.peak_tflops)


def run_plan(s: Settings, work: str) -> dict:
    """Every (shape, job) of the plan in order, within the time budget; the models and rows built first."""
    import torch

    from rlhf.core.throughput import shape_of_pretrained

    start = time.perf_counter()
    data = write_rows(work, s.row_tokens, s.prompt_tokens, max(s.train_batch_size, s.rollout_prompts) * s.steps)
    models, shapes = {}, {}
    for shape in dict.fromkeys(shape for shape, _ in s.plan):
        models[shape] = os.path.join(work, f"model-{shape}")
        params = build_model_dir(models[shape], shape, s.device, torch.bfloat16 if s.bf16 else torch.float32)
        flops_shape = shape_of_pretrained(models[shape])
        shapes[shape] = {"params": params, "params_N": flops_shape.params, "layers": flops_shape.layers,
                         "hidden": flops_shape.hidden,
                         "train_flops_per_token": flops_shape.flops(torch.tensor([s.row_tokens]), True) / s.row_tokens}
        torch.cuda.empty_cache() if s.bf16 else None
    results: dict[str, dict[str, dict]] = {shape: {} for shape in models}
    for shape, job in s.plan:
        left = s.budget_s - (time.perf_counter() - start)
        if left < 30:
            results[shape][job] = {"status": "not run", "reason": f"BUDGET_S {s.budget_s:g} spent"}
            continue
        if job == "grpo_vllm" and importlib.util.find_spec("vllm") is None:
            results[shape][job] = {"status": "skipped", "reason": "vllm is not installed"}
            continue
        results[shape][job] = run_job(s, job, models[shape], data, os.path.join(work, f"{shape}-{job}"),
                                      min(s.job_timeout_s, left))
        print(f"[gpu_throughput] {shape} {job}: {results[shape][job]['status']} "
              f"({results[shape][job].get('seconds', 0)} s)", file=sys.stderr, flush=True)
    for jobs in results.values():
        ours, floor = jobs.get("sft", {}), jobs.get("floor", {})
        if ours.get("status") == "ok" and floor.get("status") == "ok":
            jobs["sft_over_floor"] = ours["tokens_per_s"] / floor["tokens_per_s"]
    peak, source = peak_of(s)
    return {"settings": {k: v for k, v in dataclasses.asdict(s).items() if k != "out_json"},
            "peak_tflops": peak, "peak_source": source, "shapes": shapes, "results": results,
            "seconds": round(time.perf_counter() - start, 1)}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(summary: dict) -> str:
    lines = ["| shape | job | status | tokens/s | TFLOP/s | MFU | step s | stage TFLOP/s | gen tok/s | ours/floor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape, jobs in summary["results"].items():
        for job, r in jobs.items():
            if not isinstance(r, dict):
                continue
            stages = ", ".join(f"{st} {fmt(v['tflops'], '.3g')}" for st, v in r.get("stages", {}).items())
            ratio = jobs.get("sft_over_floor") if job == "sft" else None
            lines.append(f"| {shape} | {job} | {r['status']} | {fmt(r.get('tokens_per_s'), '.0f')} | "
                         f"{fmt(r.get('tflops'), '.4g')} | {fmt(r.get('mfu'), '.1%')} | "
                         f"{fmt(r.get('time_step_s'), '.3f')} | "
                         f"{stages or '-'} | {fmt(r.get('generated_tokens_per_s'), '.0f')} | {fmt(ratio, '.3f')} |")
    return "\n".join(lines)


def main() -> None:
    settings = Settings.from_env(dict(os.environ))
    with tempfile.TemporaryDirectory(prefix="gpu_throughput-") as work:
        summary = run_plan(settings, work)
    text = json.dumps(summary)
    with open(settings.out_json, "w") as f:
        f.write(text + "\n")
    print(table(summary), flush=True)
    print(text, flush=True)


if __name__ == "__main__":
    main()
