"""`rlhf.repulse.plots` and `python -m rlhf.cli.plot_repulse` (pure CPU): the 95% t-interval against hand
numbers and an independent integral of the t density, reading metrics.jsonl, aligning and truncating seeds,
the summary from synthetic runs, the CLI writing valid PNGs, and each usage error."""

from __future__ import annotations

import json
import math

import pytest

from rlhf.config.errors import UsageError
from rlhf.repulse import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, evals, heldout=None, gcg=None, other_rows=True):
    """A run directory whose metrics.jsonl has one evaluation row per (samples, log_p_bad, reward, return)
    tuple, with training rows (no log_p_bad) between them, the held-out keys on the last row, and gcg.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for step, (samples, lpb, reward, ret) in enumerate(evals):
        if other_rows:
            rows.append({"step": step, "reward_mean": 99.0, "loss": 1.0})
        rows.append({"step": step, "samples_drawn": samples, "log_p_bad": lpb, "reward_mean": reward,
                     "return_mean": ret})
    if heldout is not None:
        rows.append({"step": len(evals), **heldout})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if gcg is not None:
        (run_dir / "gcg.json").write_text(json.dumps({"attack_success_rate": gcg}))
    return str(run_dir)


def hw(values):
    """Half-width by hand for the tests: t · s / sqrt(n)."""
    n = len(values)
    m = sum(values) / n
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    return plots.T_975[n - 1] * s / math.sqrt(n)


# ---------------------------------------------------------------- t-interval


def test_t_interval_hand_values():
    mean, half = plots.mean_half_width([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.303 / math.sqrt(3))
    mean, half = plots.mean_half_width([0.0, 4.0])  # s = 2*sqrt(2), n = 2
    assert mean == 2.0
    assert half == pytest.approx(12.706 * 2 * math.sqrt(2) / math.sqrt(2))
    assert plots.mean_half_width([5.0]) == (5.0, 0.0)
    assert plots.mean_half_width([7.0] * 4) == (7.0, 0.0)
    assert plots.t_quantile_975(4) == 2.776 and plots.t_quantile_975(9) == 2.262
    assert plots.t_quantile_975(29) == 2.045 and plots.t_quantile_975(30) == 2.042
    assert plots.t_quantile_975(31) == 1.96 and plots.t_quantile_975(1000) == 1.96
    values = [float(v) for v in range(40)]  # df 39 > 30: normal quantile
    s = math.sqrt(sum((v - 19.5) ** 2 for v in values) / 39)
    assert plots.mean_half_width(values)[1] == pytest.approx(1.96 * s / math.sqrt(40))


def _t_cdf_above_half(t: float, df: int, steps: int = 4000) -> float:
    """P(0 < T < t) for Student t with `df` degrees of freedom, by Simpson's rule on its density."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    f = [c * (1 + (t * k / steps) ** 2 / df) ** (-(df + 1) / 2) for k in range(steps + 1)]
    return t / steps / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


def test_t_table_is_the_975_quantile():
    """Each tabled value is t_{0.975, df} to its 3 decimals: the CDF there is 0.975 within what rounding the
    quantile by 0.0005 can move it."""
    for df, t in plots.T_975.items():
        density = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2)) * \
            (1 + t * t / df) ** (-(df + 1) / 2)
        assert abs(0.5 + _t_cdf_above_half(t, df) - 0.975) <= density * 0.0005 + 1e-6, df


# ---------------------------------------------------------------- loading and alignment


def test_load_run_keeps_only_evaluation_rows(tmp_path):
    path = write_run(tmp_path / "r", [(8, -1.0, 0.5, 0.4), (16, -2.0, 0.6, 0.5)],
                     heldout={"heldout_return_mean": 0.3, "heldout_p_below": 0.1, "heldout_cvar": -1.5}, gcg=0.25)
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "samples_drawn": 24, "log_p')  # a line cut by a crash
    run = plots.load_run(path)
    assert run.curves == {"samples_drawn": [8.0, 16.0], "log_p_bad": [-1.0, -2.0], "reward_mean": [0.5, 0.6],
                          "return_mean": [0.4, 0.5]}
    assert run.heldout == {"heldout_return_mean": 0.3, "heldout_p_below": 0.1, "heldout_cvar": -1.5}
    assert run.gcg_attack_success_rate == 0.25
    bare = plots.load_run(write_run(tmp_path / "bare", [(8, -1.0, 0.5, 0.4)], other_rows=False))
    assert bare.heldout is None and bare.gcg_attack_success_rate is None


def test_align_seeds_truncates_to_shortest_and_warns(tmp_path):
    runs = [plots.load_run(write_run(tmp_path / "a", [(10, -1.0, 1.0, 1.0), (20, -2.0, 2.0, 2.0),
                                                      (30, -3.0, 3.0, 3.0)])),
            plots.load_run(write_run(tmp_path / "b", [(10, -3.0, 3.0, 3.0), (20, -4.0, 4.0, 4.0)]))]
    curves, warnings = plots.align_seeds("RePULSe", runs)
    assert curves.num_rows == 2 and curves.num_seeds == 2
    assert curves.mean["samples_drawn"] == [10.0, 20.0]
    assert curves.mean["log_p_bad"] == [-2.0, -3.0]
    assert curves.half_width["log_p_bad"] == pytest.approx([hw([-1.0, -3.0]), hw([-2.0, -4.0])])
    assert len(warnings) == 1 and "method RePULSe" in warnings[0] and "first 2" in warnings[0]
    curves, warnings = plots.align_seeds("same", runs[1:] * 2)
    assert warnings == [] and curves.half_width["log_p_bad"] == [0.0, 0.0]


def test_align_seeds_warns_when_samples_drawn_differ(tmp_path):
    runs = [plots.load_run(write_run(tmp_path / "a", [(10, -1.0, 1.0, 1.0)])),
            plots.load_run(write_run(tmp_path / "b", [(12, -1.0, 1.0, 1.0)]))]
    curves, warnings = plots.align_seeds("PPO", runs)
    assert curves.mean["samples_drawn"] == [11.0]
    assert len(warnings) == 1 and "samples_drawn" in warnings[0] and "PPO" in warnings[0]


def test_method_summary_numbers(tmp_path):
    finals = [(-2.0, 0.5, 0.2), (-3.0, 0.7, 0.4), (-4.0, 0.6, 0.9)]
    heldouts = [(0.1, 0.2, -1.0), (0.3, 0.1, -2.0), (0.5, 0.3, -1.5)]
    runs = [plots.load_run(write_run(tmp_path / f"s{i}", [(64, -1.0, 0.0, 0.0), (128, lpb, rew, ret)],
                                     heldout=dict(zip(plots.HELDOUT_KEYS, heldouts[i])), gcg=0.1 * (i + 1)))
            for i, (lpb, rew, ret) in enumerate(finals)]
    entry = plots.method_summary(runs, plots.align_seeds("RePULSe", runs)[0])
    assert entry["num_seeds"] == 3 and entry["num_eval_rows"] == 2 and entry["final_samples_drawn"] == 128
    assert entry["runs"] == [str(tmp_path / f"s{i}") for i in range(3)]
    assert entry["log_p_bad"]["mean"] == pytest.approx(-3.0)
    assert entry["log_p_bad"]["half_width"] == pytest.approx(4.303 / math.sqrt(3))  # s = 1
    assert entry["reward_mean"]["mean"] == pytest.approx(0.6)
    assert entry["reward_mean"]["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert entry["return_mean"]["mean"] == pytest.approx(0.5)
    assert entry["return_mean"]["half_width"] == pytest.approx(hw([0.2, 0.4, 0.9]))
    assert entry["heldout_return_mean"]["mean"] == pytest.approx(0.3)
    assert entry["heldout_return_mean"]["half_width"] == pytest.approx(4.303 * 0.2 / math.sqrt(3))
    assert entry["heldout_cvar"]["mean"] == pytest.approx(-1.5)
    assert entry["heldout_p_below"]["mean"] == pytest.approx(0.2)
    assert entry["gcg_attack_success_rate"]["mean"] == pytest.approx(0.2)
    assert entry["gcg_attack_success_rate"]["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    without = plots.method_summary(runs[:1], plots.align_seeds("x", runs[:1])[0])
    assert without["log_p_bad"] == {"mean": -2.0, "half_width": 0.0}


def test_null_values_read_as_nan_and_summarise_as_null(tmp_path):
    run = plots.load_run(write_run(tmp_path / "a", [(10, None, 1.0, 1.0)]))
    assert math.isnan(run.curves["log_p_bad"][0])
    entry = plots.method_summary([run], plots.align_seeds("x", [run])[0])
    assert entry["log_p_bad"] == {"mean": None, "half_width": None}


# ---------------------------------------------------------------- CLI end to end


def test_cli_writes_figures_and_summary(tmp_path, capsys):
    from rlhf.cli.plot_repulse import main

    def method(name, shift, gcg):
        return ",".join(write_run(tmp_path / f"{name}{s}", [(32 * (k + 1), -1.0 - shift * k - 0.1 * s, 0.1 * k,
                                                              0.1 * k - 0.01 * s) for k in range(4)],
                                  heldout={"heldout_return_mean": 0.2 + s * 0.01, "heldout_p_below": 0.1,
                                           "heldout_cvar": -1.0 - shift}, gcg=gcg) for s in range(3))

    out = tmp_path / "figs"
    main(["--runs", f"REINFORCE={method('rf', 0.1, 0.5)}", f"RePULSe={method('rp', 0.5, 0.2)}", "--out", str(out),
          "--title", "toy"])
    printed = capsys.readouterr().out
    for name in ("training_curves.png", "frontier.png", "summary.json"):
        assert f"wrote {out / name}" in printed
    for name in ("training_curves.png", "frontier.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["REINFORCE", "RePULSe"]
    rp = summary["RePULSe"]
    assert rp["num_seeds"] == 3 and rp["final_samples_drawn"] == 128
    assert rp["log_p_bad"]["mean"] == pytest.approx(-2.6)
    assert rp["log_p_bad"]["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert rp["return_mean"]["mean"] == pytest.approx(0.29)
    assert rp["gcg_attack_success_rate"] == {"mean": pytest.approx(0.2), "half_width": pytest.approx(0.0, abs=1e-12)}
    assert summary["REINFORCE"]["heldout_cvar"]["mean"] == pytest.approx(-1.1)
    assert "note:" not in printed and "warning:" not in printed


def test_cli_notes_one_seed_missing_heldout_and_truncation(tmp_path, capsys):
    from rlhf.cli.plot_repulse import main

    one = write_run(tmp_path / "one", [(8, -1.0, 0.1, 0.1)])
    a = write_run(tmp_path / "a", [(8, -1.0, 0.1, 0.1), (16, -2.0, 0.2, 0.2)])
    b = write_run(tmp_path / "b", [(8, -1.5, 0.1, 0.1)])
    main(["--runs", f"single={one}", "--runs", f"ragged={a},{b}", "--out", str(tmp_path / "o")])
    printed = capsys.readouterr().out
    assert "note: method single has one seed" in printed
    assert "warning: method ragged: its seeds have different numbers of evaluation rows" in printed
    assert "frontier.png has no held-out panel" in printed
    assert (tmp_path / "o" / "frontier.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["ragged"]["num_eval_rows"] == 1 and summary["ragged"]["log_p_bad"]["mean"] == -1.25
    assert "heldout_cvar" not in summary["ragged"]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("item", ["REINFORCE", "=d1", "A=", "A=d1,,d2", "A=d1,d1"])
def test_malformed_runs_item(item):
    with pytest.raises(UsageError, match=f"--runs item {item!r}.*METHOD=DIR1,DIR2|--runs item {item!r} names"):
        plots.parse_runs_item(item)


def test_errors_name_the_path_and_fix(tmp_path, capsys):
    from rlhf.cli.plot_repulse import main

    def error_of(*runs):
        with pytest.raises(SystemExit) as exit_info:
            main(["--runs", *runs, "--out", str(tmp_path / "o")])
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    missing = tmp_path / "nowhere"
    assert f"error: run directory {missing} does not exist: pass the --save_path" in error_of(f"A={missing}")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"error: {empty / 'metrics.jsonl'} not found: {empty} is not a run directory" in error_of(f"A={empty}")
    train_only = tmp_path / "train_only"
    train_only.mkdir()
    (train_only / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    assert f"error: {train_only / 'metrics.jsonl'} has no evaluation rows (rows with log_p_bad)" in \
        error_of(f"A={train_only}")
    assert "error: --runs item 'A' is malformed: write it as METHOD=DIR1,DIR2" in error_of("A")
    ok = write_run(tmp_path / "ok", [(8, -1.0, 0.1, 0.1)])
    assert "error: --runs: method 'A' is given twice" in error_of(f"A={ok}", f"A={ok}")
    assert not (tmp_path / "o").exists()


def test_malformed_rows_name_the_line(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "log_p_bad": -1.0, "reward_mean": 0.1}\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl:1: evaluation row .* lacks samples_drawn, return_mean"):
        plots.load_run(str(run))
    (run / "metrics.jsonl").write_text('not json\n{"step": 1}\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl:1: not a JSON object"):
        plots.load_run(str(run))
    (run / "metrics.jsonl").write_text('{"samples_drawn": 8, "log_p_bad": "low", "reward_mean": 0, '
                                       '"return_mean": 0}\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl:1: log_p_bad is 'low', not a number"):
        plots.load_run(str(run))
    (run / "metrics.jsonl").write_text('{"samples_drawn": 8, "log_p_bad": -1, "reward_mean": 0, "return_mean": 0}\n')
    (run / "gcg.json").write_text('{"asr": 0.1}')
    with pytest.raises(UsageError, match=r"gcg.json: no 'attack_success_rate' key"):
        plots.load_run(str(run))
