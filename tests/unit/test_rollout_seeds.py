"""Every prompt samples from its own seed, derived from (run seed, step, global prompt index): identical
prompts in different rows get different samples, distributed as the model says, and the samples of a
global prompt do not depend on how many engines (or TP ranks) drew them.

The statistical checks compare first-token samples of one prompt with the model's own next-token
distribution at a temperature picked so that it is neither flat nor one-hot. With one seed shared by
the batch (the old behaviour) every row of a prompt drew the same stream: collision rate 1."""

import collections
import itertools
import math

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.engines.rollout import MAX_REQUEST_SEED, SamplingSpec, request_seed
from rlhf.models.loading import load_causal_lm, load_tokenizer
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


def test_request_seed_is_stable_spread_and_in_range():
    seeds = {request_seed(run, step, i) for run in (0, 42) for step in range(50) for i in range(64)}
    assert len(seeds) == 2 * 50 * 64
    assert all(0 <= s <= MAX_REQUEST_SEED for s in seeds)
    # pinned: changing the derivation changes every run's rollouts
    assert request_seed(42, 3, 5) == request_seed(42, 3, 5) == 4300243041286389593
    # neighbouring indices do not give neighbouring seeds (vLLM gives sample k of a request seed + k)
    assert min(abs(request_seed(0, 0, i + 1) - request_seed(0, 0, i)) for i in range(64)) > 1 << 20


def test_hf_engine_samples_each_prompt_from_its_own_seed(stat_distribution):
    from rlhf.engines.hf_engine import HFGenerateEngine

    temperature, probs = stat_distribution
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    engine = HFGenerateEngine(EMBEDDED_MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"),
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompt = tok(worker.STAT_PROMPT, add_special_tokens=False)["input_ids"]
    seeds = [request_seed(7, 0, i) for i in range(worker.NUM_STAT_REQUESTS)]
    rng_state = torch.random.get_rng_state()
    one = engine.generate([prompt] * len(seeds), SamplingSpec(1, temperature, 1.0, 1), seeds)
    num = worker.NUM_CHILD_REQUESTS
    children = engine.generate([prompt] * num, SamplingSpec(worker.NUM_CHILDREN, temperature, 1.0, 1), seeds[:num])
    assert torch.equal(torch.random.get_rng_state(), rng_state), "the caller's RNG state must be restored"
    check_first_tokens([g[0].token_ids[0] for g in one], [[g.token_ids[0] for g in gs] for gs in children], probs)
    # whole responses: the same prompt in 4 rows, 4 samples each, 16 different responses; reproducible
    spec = SamplingSpec(4, temperature, 1.0, 6)
    gens = engine.generate([prompt] * 4, spec, seeds[:4])
    assert len({tuple(g.token_ids) for gs in gens for g in gs}) == 16
    assert engine.generate([prompt] * 2, spec, seeds[2:4]) == gens[2:]
