"""Evaluation during RL (--eval_dataset): a run with evaluation on trains to the same weights, bit for bit, as the
same run with it off (its samples have their own seeds)."""

import json

import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_PROMPTS
from tests.distributed import run_job_variants
from tests.tiny_runs import SMALL, read_metrics


def test_eval_on_trains_the_same_weights_as_eval_off(tmp_path):
    rows = [json.loads(line) for line in open(EMBEDDED_PROMPTS)][:6]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({**row, "datasource": "even" if i % 2 == 0 else "odd"}) + "\n"
                                 for i, row in enumerate(rows)))
    run = [*SMALL, "--rollout_engine", "hf", "--zero_stage", "2", "--max_steps", "4", "--seed", "7"]

    evaluation = ["--eval_dataset", str(eval_file), "--eval_steps", "3", "--eval_n_samples_per_prompt", "2",
                  "--eval_temperature", "0.7"]
    run_job_variants(1, [("train_ppo", [*run, "--save_path", str(tmp_path / "off")]),
                         ("train_ppo", [*run, "--save_path", str(tmp_path / "on"), *evaluation])],
                     tmp_path / "consoles", tmp_path / "off", tmp_path / "on")
    off_rows, off = read_metrics(tmp_path / "off"), load_file(tmp_path / "off" / "model" / "model.safetensors")
    on_rows, on = read_metrics(tmp_path / "on"), load_file(tmp_path / "on" / "model" / "model.safetensors")
    for name, weight in off.items():
        torch.testing.assert_close(on[name], weight, rtol=0, atol=0, msg=name)
    evals = [r for r in on_rows if "eval/even_pass1" in r]
    assert [r["step"] for r in evals] == [0, 3, 4]  # before training, every 3 steps, after the last
    for r in evals:
        for source in ("even", "odd"):
            assert 0 <= r[f"eval/{source}_pass1"] <= r[f"eval/{source}_pass2"] <= 1
    training = [r for r in on_rows if r["step"] > 0]
    assert [r["reward_mean"] for r in training] == [r["reward_mean"] for r in off_rows]
