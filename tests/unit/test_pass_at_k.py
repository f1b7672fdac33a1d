"""Evaluation during RL: pass1/pass{k} per data source by hand."""


import pytest
import torch

from rlhf.trainers.prompt_eval import source_metrics


def test_pass_at_k_per_data_source_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 0.5], [0.25, 0.25, 0.25], [1.0, 0.0, 0.0]])
    got = source_metrics(rewards, ["math", "code", "math"])
    assert got == pytest.approx({
        "eval/code_pass1": 0.25, "eval/code_pass3": 0.25,
        "eval/math_pass1": (1.5 / 3 + 1.0 / 3) / 2, "eval/math_pass3": 1.0,
    })
    assert source_metrics(rewards[:, :1], ["a", "a", "a"]) == pytest.approx({"eval/a_pass1": 1.25 / 3})
