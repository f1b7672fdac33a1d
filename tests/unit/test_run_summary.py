"""The end of a run: the summary block (first and last fifth of each main metric, held-out metrics first and
last, speed and stage shares, memory against the plan, outputs), the plots of its curves and their command line
(one run, several overlaid), and the watchdog's patience with an announced one-time build."""

import io
import json
import struct

import pytest

from rlhf.cli import plot as plot_cli
from rlhf.core.run_summary import first_last, summary_block
from rlhf.utils import watchdog
from rlhf.utils.curves import moving_average, plot_runs, plotted_metrics
from rlhf.utils.watchdog import Watchdog


def rows(n: int = 10) -> list[dict]:
    """Steps 1..n: reward = step / 10, two stages of 0.1 s and 0.3 s, 1000 tokens/s; held-out loss at 0, 5, 10."""
    out = [{"step": 0, "eval_loss": 3.0}]
    for step in range(1, n + 1):
        row = {"step": step, "reward_mean": step / 10, "time/generation": 0.1, "time/train": 0.3, "time/step": 0.5,
               "perf/tokens_per_s": 1000.0 if step > 1 else 10.0}
        if step % 5 == 0:
            row["eval_loss"] = 3.0 - step / 10
        out.append(row)
    return out


def test_first_and_last_fifth():
    points = [(s, float(s)) for s in range(1, 11)]
    assert first_last(points) == (1.5, 9.5, "steps 1-2 -> 9-10")  # n // 5 = 2 points each
    assert first_last(points[:4]) == (1.0, 4.0, "step 1 -> 4")  # fewer than ten: one point each


def test_summary_block_values(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    memory = {"0": {"train": {"measured": 2**30, "estimated": 2**29}},
              "1": {"train": {"measured": 3 * 2**30, "estimated": 2**29}}}
    lines = summary_block(rows(), ("reward_mean", "kl"), name="rl", wall_s=125.4, resumed_after=4,
                          outputs=[("model", str(model)), ("TensorBoard", str(tmp_path / "absent"))], memory=memory)
    assert lines[0] == "rl run summary: 10 steps, 2 min 05 s in this process, resumed after step 4"
    assert lines[1] == "  reward_mean  0.150 -> 0.950  (steps 1-2 -> 9-10)"  # no kl logged: no line
    assert lines[2] == "  eval_loss    3.000 -> 2.000  (step 0 -> 10)"  # first and last evaluation
    # steps after the first: 0.5 s each, 1000 tokens/s, generation 0.1/0.5, train 0.3/0.5
    assert lines[3] == "  speed: 0.5 s/step, 1,000 trained tokens/s (generation 20%, train 60%)"
    assert lines[4] == "  memory peak/plan, GiB (largest rank): train 3.00/0.50"
    assert lines[5] == f"  outputs: model {model}"  # paths that do not exist are not shown
    assert len(lines) == 6


def test_plots_of_one_run_and_an_overlay(tmp_path, capsys):
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    runs = {"a": rows(), "b": [{**r, "reward_mean": r["reward_mean"] / 2} for r in rows() if "reward_mean" in r]}
    assert plotted_metrics(runs, ("reward_mean",)) == ["reward_mean", "perf/tokens_per_s", "eval_loss"]
    written = plot_runs(runs, str(tmp_path / "p"), ("reward_mean",))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == [
        "eval_loss.png", "perf_tokens_per_s.png", "reward_mean.png", "stage_time.png"]
    for path in written:  # a PNG of the size drawn (640 x 400)
        head = open(path, "rb").read(24)
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (640, 400)
    for name, run in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run) + '{"step": 1')
    plot_cli.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp"),
                   "--metrics", "reward_mean", "--labels", "base", "half"])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'cmp' / 'reward_mean.png'}\n"
    plot_cli.main([str(tmp_path / "a")])  # one run: into its own plots/
    assert (tmp_path / "a" / "plots" / "stage_time.png").is_file()
    with pytest.raises(SystemExit):
        plot_cli.main([str(tmp_path / "a"), "--metrics", "nope"])
    assert "--metrics nope: no run logged it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_cli.main([str(tmp_path / "missing")])
    assert "no metrics.jsonl there" in capsys.readouterr().err


def test_watchdog_waits_out_an_announced_build():
    now, out = [0.0], io.StringIO()
    with watchdog.stage("building DeepSpeed's op", patience_s=600):
        dog = Watchdog(0, 20.0, clock=lambda: now[0], out=out)
        now[0] = 599.0
        assert dog.check() is None  # no "no progress" alarm during the announced build
        now[0] = 600.0
        assert "no progress for 600 s: in stage 'building DeepSpeed's op'" in dog.check()
    with watchdog.stage("train"):  # patience ends with its stage
        dog = Watchdog(0, 20.0, clock=lambda: now[0], out=out)
        now[0] = 620.0
        assert "no progress for 20 s: in stage 'train'" in dog.check()


def test_ppo_summary_shows_the_rewards_own_logs(tmp_path, capsys):
    """PPO's summary adds every `reward_extra/` metric the rows hold (what a reward function or an agent logs of
    its own, such as an agent's turns per episode) after its main metrics."""
    import time
    from types import SimpleNamespace

    from rlhf.core.run import print_summary
    from rlhf.trainers.ppo_run import PPORun

    run = [{**r, "reward_extra/agent_turns": 2.0 - r["step"] / 10} for r in rows() if "reward_mean" in r]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run))
    cfg = SimpleNamespace(logging=SimpleNamespace(save_path=str(tmp_path), use_tensorboard=None, no_plots=False))
    print_summary(PPORun(), cfg, time.time(), 0, str(tmp_path / "no_peaks.json"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["  reward_mean               0.150 -> 0.950  (steps 1-2 -> 9-10)",
                          "  reward_extra/agent_turns  1.850 -> 1.050  (steps 1-2 -> 9-10)"]
    assert (tmp_path / "plots" / "reward_extra_agent_turns.png").is_file()
    assert f"plots {tmp_path / 'plots'}" in lines[-1]
    # --no_plots: none drawn, and the plots of an earlier run in the directory are not named as this run's
    (tmp_path / "plots" / "reward_extra_agent_turns.png").unlink()
    cfg = SimpleNamespace(logging=SimpleNamespace(save_path=str(tmp_path), use_tensorboard=None, no_plots=True))
    print_summary(PPORun(), cfg, time.time(), 0, str(tmp_path / "no_peaks.json"))
    again = capsys.readouterr().out.splitlines()
    assert again[1:3] == lines[1:3] and "outputs: " in again[-1] and "plots" not in again[-1], again
    assert not (tmp_path / "plots" / "reward_extra_agent_turns.png").exists()
