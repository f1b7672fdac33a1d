"""The train_prm and train_kd example scripts (2 CPU ranks, about a minute each): held-out step accuracy of
the process reward model must rise, and the distilled student's held-out NLL must fall, so the README's figures
cannot silently go false."""

from tests.examples.scripts import before_after, metric_rows, run_script


def test_prm_example_step_accuracy_rises(tmp_path):
    run_script("prm_tiny_cpu.sh", tmp_path / "run")
    first, last = before_after(tmp_path / "run", "eval_acc", "prm_tiny_cpu.sh", "held-out step accuracy")
    assert last > 0.8 and last > first + 0.25


def test_kd_example_student_learns(tmp_path):
    run_script("kd_tiny_cpu.sh", tmp_path / "run")
    nll = metric_rows(tmp_path / "run" / "student", "eval_gpt_loss")
    kd = metric_rows(tmp_path / "run" / "student", "eval_distil_loss")
    teacher = metric_rows(tmp_path / "run" / "teacher", "eval_gpt_loss")
    print(f"kd_tiny_cpu.sh: teacher held-out NLL {teacher[-1][1]:.3f}; student held-out NLL {nll[0][1]:.3f} -> "
          f"{nll[-1][1]:.3f}, distillation loss {kd[0][1]:.3f} -> {kd[-1][1]:.3f} over {nll[-1][0]} steps")
    assert nll[0][0] == 0 and nll[-1][1] < 0.5 * nll[0][1] and kd[-1][1] < kd[0][1] - 1.0
