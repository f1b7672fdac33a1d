"""Every prompt samples from its own seed, derived from (run seed, step, global prompt index): the seed is stable,
spread and in range, and the HF engine's identical prompts in different rows get different samples, distributed as
the model says (first-token samples against the model's own next-token distribution)."""


import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.engines.rollout import MAX_REQUEST_SEED, SamplingSpec, request_seed
from rlhf.models.loading import load_tokenizer
from tests.rollout_stats import check_first_tokens
from tests.rollout_stats import stat_distribution as model_distribution
from tests.workers import rollout_seeds as worker


@pytest.fixture(scope="module")
def stat_distribution() -> tuple[float, torch.Tensor]:
    return model_distribution()


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
    again = engine.generate([prompt] * 2, spec, seeds[2:4])
    # the same samples in a smaller batch; log-probs equal up to the batched kernels' float rounding
    assert [[g.token_ids for g in gs] for gs in again] == [[g.token_ids for g in gs] for gs in gens[2:]]
    assert max(abs(a - b) for gs, hs in zip(again, gens[2:]) for g, h in zip(gs, hs)
               for a, b in zip(g.logprobs, h.logprobs)) < 1e-5
