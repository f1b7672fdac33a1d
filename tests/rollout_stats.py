"""Statistics of first-token samples that the rollout-seed tests share: the embedded model's next-token distribution
of the worker's statistics prompt at a temperature where it is neither flat nor one-hot, and the check that rows
of one prompt are independent draws from it."""

import collections
import itertools
import math

import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.models.loading import load_causal_lm, load_tokenizer
from tests.workers import rollout_seeds as worker

TEMPERATURES = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0)
TARGET_COLLISION = 0.1  # sum_v p(v)^2: far from 1 (what a shared stream gives) yet not flat


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
