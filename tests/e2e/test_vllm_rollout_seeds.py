"""Every prompt samples from its own seed, derived from (run seed, step, global prompt index): identical
prompts in different rows get different samples, distributed as the model says, and the samples of a
global prompt do not depend on how many engines (or TP ranks) drew them.

The statistical checks compare first-token samples of one prompt with the model's own next-token
distribution at a temperature picked so that it is neither flat nor one-hot. With one seed shared by
the batch (the old behaviour) every row of a prompt drew the same stream: collision rate 1."""

import collections
import itertools
import json
import math

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.models.loading import load_causal_lm, load_tokenizer
from tests.distributed import run_torchrun
from tests.workers import rollout_seeds as worker

TEMPERATURES = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0)
TARGET_COLLISION = 0.1  # sum_v p(v)^2: far from 1 (what a shared stream gives) yet not flat


@pytest.fixture(scope="module")
def stat_distribution() -> tuple[float, torch.Tensor]:
    """(temperature, next-token probabilities of `worker.STAT_PROMPT` at it) from the fp32 HF model."""
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")
    ids = tok(worker.STAT_PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    collision = {t: float((logits / t).softmax(-1).square().sum()) for t in TEMPERATURES}
    temperature = min(TEMPERATURES, key=lambda t: abs(math.log(collision[t] / TARGET_COLLISION)))
    return temperature, (logits / temperature).softmax(-1)


def check_first_tokens(first_tokens: list[int], child_first_tokens: list[list[int]], probs: torch.Tensor) -> None:
    """Independent rows of one prompt: each token's frequency within a 5-sigma binomial band of its
    probability, and the rate at which two rows (or two of the n samples of one request) agree close to
    the collision probability sum_v p(v)^2."""
    n = len(first_tokens)
    counts = collections.Counter(first_tokens)
    for v, p in enumerate(probs.tolist()):
        assert abs(counts[v] / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1 / n, (v, counts[v] / n, p)
    collision = float(probs.square().sum())
    # unbiased estimate over all pairs of rows; its std is ~ sqrt(4 (sum p^3 - c^2) / n)
    pairs = sum(c * (c - 1) for c in counts.values()) / (n * (n - 1))
    std = math.sqrt(4 * max(float(probs.pow(3).sum()) - collision**2, 0.0) / n + 2 * collision / n**2)
    assert abs(pairs - collision) <= 5 * std, (pairs, collision, std)
    agree = [a == b for tokens in child_first_tokens for a, b in itertools.combinations(tokens, 2)]
    # the pairs of one request are dependent: a loose band (the failure it guards against gives 1)
    assert abs(sum(agree) / len(agree) - collision) <= 0.1, (sum(agree) / len(agree), collision)


@pytest.fixture(scope="module")
def one_engine_report(tmp_path_factory, stat_distribution) -> dict:
    """The worker's report on a single engine (world 1)."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("seeds") / "one_engine.json"
    proc = run_torchrun(1, "tests/workers/rollout_seeds.py", str(out), "1", str(stat_distribution[0]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_vllm_engine_samples_each_prompt_from_its_own_seed(one_engine_report, stat_distribution):
    report = one_engine_report
    check_first_tokens(report["first_tokens"], report["child_first_tokens"], stat_distribution[1])
    # through the trainer: every response of the repeated prompt in one step differs from the others
    for step in report["steps"].values():
        repeated = [r for p, r in zip(step["prompts"], step["responses"]) if p == worker.STAT_PROMPT]
        assert len(repeated) == 16, step["batch"]
        assert len({tuple(r) for r in repeated}) == len(repeated), step
        assert step["prompts"] == [p for p in step["batch"] for _ in range(4)]


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2], ids=["two_engines", "one_tp2_engine"])
def test_vllm_samples_do_not_depend_on_the_number_of_engines(tmp_path, one_engine_report, stat_distribution, tp):
    """World 2: two TP-1 engines, or one TP-2 engine, give each global prompt of a step the same samples
    as one engine on one rank."""
    out = tmp_path / "world2.json"
    proc = run_torchrun(2, "tests/workers/rollout_seeds.py", str(out), str(tp), str(stat_distribution[0]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["steps"].keys() == one_engine_report["steps"].keys()
    for step, expected in one_engine_report["steps"].items():
        got = report["steps"][step]
        assert got["prompts"] == expected["prompts"]
        assert got["responses"] == expected["responses"], step
        assert got["finish_reasons"] == expected["finish_reasons"]
        assert sum(map(len, got["responses"])) > 2 * len(got["responses"])  # not cut short after a token
