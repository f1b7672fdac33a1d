"""Flags and readers shared by the tests that run the jobs on the embedded tiny demo."""

import json
import os

CPU = ["--param_dtype", "fp32", "--attn_implementation", "sdpa"]
"""What the tests run in (the defaults are OpenRLHF's: bf16 and flash-attn)."""
TRAIN = [*CPU, "--no_plots"]
"""What the tests' training runs add: no plots at the end (a tenth of a second per figure, and the e2e runs would draw
hundreds that nothing reads). The examples' runs draw theirs, and tests/examples/test_rl_examples.py checks the
quickstart's."""
EAGER = ["--enforce_eager"]
"""vLLM without torch.compile in the e2e runs: each runs a few steps, and loading the compiled model from vLLM's
cache still costs a few CPU-seconds per rank (the first compile on a machine 15-20 s); the compiled default runs in
tests/examples (every learning run) and in the e2e runs of OpenRLHF's own commands
(tests/e2e/test_openrlhf_command_run.py)."""
SMALL = [*TRAIN, *EAGER, "--init_kl_coef", "0", "--advantage_estimator", "group_norm",
         "--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--train_batch_size", "8",
         "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "6",
         "--prompt_max_len", "16", "--label_key", "label", "--actor_learning_rate", "1e-3", "--max_steps", "3"]
SUPERVISED = [*TRAIN, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32",
              "--max_epochs", "1", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--max_steps", "4",
              "--eval_steps", "2", "--zero_stage", "2"]
"""4 steps of a supervised job on 2 ranks (ZeRO-2, padded), evaluated at steps 0, 2 and 4."""
SUPERVISED_LAYOUTS = {  # name -> (ranks, flags); the ring runs one data-parallel replica: twice the micro-batch
    "dp1": (1, ()),
    "packed": (2, ("--packing_samples",)),
    "ring": (2, ("--packing_samples", "--ring_attn_size", "2", "--micro_train_batch_size", "16")),
    "tensor_parallel": (2, ("--ds_tensor_parallel_size", "2")),  # one replica: accumulation 2, as dp1
    "zero3_checkpointing": (2, ("--zero_stage", "3", "--gradient_checkpointing")),  # last: see run_jobs
}
"""The layouts whose steps must equal SUPERVISED's."""


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_timings(row: dict) -> dict:
    """A metrics row without its wall-clock measurements (time/*, perf/*): what two runs that took the same steps
    share bit for bit."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}


def run_job(nproc: int, module: str, out, *args: str) -> tuple[list[dict], dict, str]:
    """`rlhf.cli.<module> args --save_path out` on `nproc` CPU ranks of a supervised job (`run_jobs` of one run):
    its metrics rows, its saved weights (model.safetensors) and its console output."""
    import pathlib

    out = pathlib.Path(out)
    return run_jobs(nproc, [(module, out, list(args))], out.parent)[0]


def run_jobs(nproc: int, runs: list[tuple[str, object, list[str]]], tmp) -> list[tuple[list[dict], dict, str]]:
    """For each (module, out, args) of `runs`, `rlhf.cli.<module> args --save_path out`: its metrics rows, saved
    weights and console output; all in the same `nproc` CPU rank processes (`tests.distributed.run_job_variants`):
    one process start for several variants. Put ZeRO-3 runs last: the hooks that make
    transformers build a model partitioned stay installed in the process."""
    from safetensors.torch import load_file

    from tests.distributed import run_job_variants

    texts = run_job_variants(nproc, [(module, [*args, "--save_path", str(out)]) for module, out, args in runs],
                             tmp / f"consoles-{len(os.listdir(tmp))}", *(out for _, out, _ in runs),
                             timeout=1200)
    return [(read_metrics(out), load_file(os.path.join(out, "model.safetensors")), text)
            for (_, out, _), text in zip(runs, texts)]


def assert_same_steps(ref: tuple, other: tuple, compared: tuple[str, ...], rel: float, abs_: float,
                      what: str = "") -> None:
    """Two `run_job` results took the same steps: every compared metric of every step, and the final weights
    (AdamW's bound, `assert_adam_weights_close`, at the run's largest logged lr over its optimizer steps; the
    metrics' tolerances where no lr is logged)."""
    import pytest
    import torch

    assert [r["step"] for r in other[0]] == [r["step"] for r in ref[0]], what
    for a, b in zip(ref[0], other[0]):
        for key in compared:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=abs_), (what, a["step"], key, a[key], b[key])
    lrs = [r["lr"] for r in ref[0] if r.get("lr")]
    if lrs:
        assert ref[1].keys() == other[1].keys(), what
        assert_adam_weights_close(ref[1], other[1], max(lrs), len(lrs), what=what)
        return
    for name, w in ref[1].items():
        torch.testing.assert_close(other[1][name], w, rtol=rel, atol=abs_, msg=f"{what} {name}")


ADAM_EPS = 1e-8
"""DeepSpeed's and torch's AdamW epsilon (the product does not change it)."""


def assert_adam_weights_close(ref: dict, other: dict, lr: float, steps: int, what: str = "",
                              agree: float = 0.01, share: float = 1e-4) -> None:
    """The weights of two paths after `steps` AdamW steps whose gradients differ only by float32 rounding (another
    summation order: other ranks, micro-batches, placements).

    AdamW moves a weight by lr·m̂/(√v̂ + ε), at most lr per step with betas (0.9, 0.95) ((1-β1)/√(1-β2) < 1). A
    rounding error δ in a gradient g changes that move by about lr·ε·δ/(|g| + ε)²: nothing where |g| ≫ ε, but up
    to lr·δ/ε where |g| ≲ ε, capped by the move itself (the two paths may move such a weight by +lr and -lr: the
    first step is lr·g/(|g| + ε)). Measured (tests/e2e/test_placement_equivalence.py, 139,584 weights, one
    step): every weight that differed by more than 1e-6 had moved by 0.44-0.86 lr, i.e. |g| within ~1e-8 of
    zero; every weight that moved by the full lr agreed within 1e-6. So: every weight agrees within `agree`·lr
    (100x above the rounding seen) but for at most `share` of them (the near-zero gradients), and those within
    the 2·lr·steps that two AdamW paths can differ by at all. A wrong gradient (a missed all-reduce, a wrong
    group, a lost micro-batch) moves most weights by ~lr and fails the first bound."""
    import torch

    far = total = 0
    worst, worst_name = 0.0, ""
    for name, w in ref.items():
        diff = (other[name].double() - w.double()).abs()
        assert torch.isfinite(diff).all(), f"{what}: {name} holds non-finite weights"
        total += diff.numel()
        far += int((diff > agree * lr).sum())
        if float(diff.max()) > worst:
            worst, worst_name = float(diff.max()), name
    assert far <= share * total, (f"{what}: {far} of {total} weights differ by more than {agree} lr (worst {worst:.3g} "
                                  f"in {worst_name}): more than near-zero gradients can explain")
    assert worst <= 2 * lr * steps * (1 + 1e-6), f"{what}: {worst_name} differs by {worst:.3g} > 2 lr x {steps} steps"


def gcg_main(argv: list[str]) -> str:
    """`evaluate_gcg` with `argv` in this process; its standard output."""
    import contextlib
    import io

    from rlhf.cli.evaluate_gcg import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    return out.getvalue()


def run_gcg_cli(argv: list[str]) -> str:
    """`evaluate_gcg` with `argv` in a forked rank (a run starts a process group and console routing, which must
    not outlive it in the test process); its standard output."""
    from tests.distributed import run_on_ranks

    return run_on_ranks(1, gcg_main, argv, init_group=False)[0]
