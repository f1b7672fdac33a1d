"""The train_prm and train_kd example scripts (2 CPU ranks, about a minute each): held-out step accuracy of
the process reward model must rise, and the distilled student's held-out NLL must fall, so the README's figures
cannot silently go false. Marked `slow` and `examples`; `.ci/run` runs them with the other examples."""

import json
import os
import subprocess

from tests.distributed import ROOT


def _evals(path, key):
    with open(path / "metrics.jsonl") as f:
        return [(row["step"], row[key]) for row in map(json.loads, f) if key in row]


def _run(script, out):
    proc = subprocess.run(["bash", f"launch/examples/{script}", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-6000:]


def test_prm_example_step_accuracy_rises(tmp_path):
    _run("prm_tiny_cpu.sh", tmp_path / "run")
    evals = _evals(tmp_path / "run", "eval_acc")
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    print(f"prm_tiny_cpu.sh: held-out step accuracy {first:.3f} before, {last:.3f} after {last_step} steps")
    assert first_step == 0 and last > 0.8 and last > first + 0.25


def test_kd_example_student_learns(tmp_path):
    _run("kd_tiny_cpu.sh", tmp_path / "run")
    nll = _evals(tmp_path / "run" / "student", "eval_gpt_loss")
    kd = _evals(tmp_path / "run" / "student", "eval_distil_loss")
    teacher = _evals(tmp_path / "run" / "teacher", "eval_gpt_loss")
    print(f"kd_tiny_cpu.sh: teacher held-out NLL {teacher[-1][1]:.3f}; student held-out NLL {nll[0][1]:.3f} -> "
          f"{nll[-1][1]:.3f}, distillation loss {kd[0][1]:.3f} -> {kd[-1][1]:.3f} over {nll[-1][0]} steps")
    assert nll[-1][1] < 0.5 * nll[0][1] and kd[-1][1] < kd[0][1] - 1.0
