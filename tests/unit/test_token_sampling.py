"""The HF engine's token choice: penalty and top-p equal transformers' logits processors on random inputs,
inverse-CDF draws hit hand-derived tokens and never a token of probability zero, and each prompt's stream is
its own generator's, whatever else is drawn and however long the decode."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopPLogitsWarper

from rlhf.engines.token_sampling import (
    STREAM_CHUNK_STEPS,
    PromptStreams,
    draw_tokens,
    next_tokens,
    penalize_repeats,
    top_p_filter,
)


def random_logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    logits_BV = random_logits()
    ids_BS = torch.randint(0, 50, (6, 9), generator=torch.Generator().manual_seed(1))
    seen_BV = torch.zeros(6, 50, dtype=torch.bool).scatter(1, ids_BS, True)
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids_BS, logits_BV.clone())
    assert torch.equal(penalize_repeats(logits_BV, seen_BV, penalty), want)
    assert not torch.equal(want, logits_BV)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_matches_transformers(top_p):
    scores_BV = random_logits(seed=2)
    got = top_p_filter(scores_BV, top_p)
    assert torch.equal(got, TopPLogitsWarper(top_p)(None, scores_BV.clone()))
    kept = torch.isfinite(got)
    assert kept.any(-1).all() and (top_p > 0.9 or not kept.all())


def test_inverse_cdf_draws():
    probs_BV = torch.tensor([[0.1, 0.0, 0.6, 0.3]] * 6 + [[0.5, 0.5, 0.0, 0.0]])
    u_B = torch.tensor([0.0, 0.05, 0.1, 0.69, 0.71, 1 - 2**-53, 1 - 2**-53], dtype=torch.float64)
    # cumulative [0.1, 0.1, 0.7, 1.0]: 0.1 is past token 0's interval and token 1 has none
    assert draw_tokens(probs_BV, u_B).tolist() == [0, 0, 2, 2, 3, 3, 1]
    # a stratified grid of uniforms lands on each token within one of its expected count
    probs_1V = random_logits(rows=1, vocab=20, seed=3).softmax(-1)
    grid = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000
    counts = torch.bincount(draw_tokens(probs_1V.expand(10_000, -1), grid), minlength=20)
    assert (counts - probs_1V[0].double() * 10_000).abs().max() <= 1


def test_next_tokens_logprobs_and_rules():
    logits_BV = random_logits(rows=64, seed=4)
    seen_BV = torch.rand(64, 50, generator=torch.Generator().manual_seed(5)) < 0.2
    u_B = torch.rand(64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    tokens_B, logprobs_B = next_tokens(logits_BV, temperature=0.7, top_p=0.6, repetition_penalty=1.2,
                                       seen_BV=seen_BV, uniforms_B=u_B)
    allowed_BV = torch.isfinite(top_p_filter(penalize_repeats(logits_BV, seen_BV, 1.2) / 0.7, 0.6))
    assert allowed_BV.gather(1, tokens_B[:, None]).all()
    want_B = (logits_BV / 0.7).log_softmax(-1).gather(1, tokens_B[:, None])[:, 0]  # before penalty and top-p
    assert torch.equal(logprobs_B, want_B)
    greedy_B, greedy_lp_B = next_tokens(logits_BV, temperature=0.0, top_p=1.0, repetition_penalty=1.2,
                                        seen_BV=seen_BV, uniforms_B=None)
    assert torch.equal(greedy_B, penalize_repeats(logits_BV, seen_BV, 1.2).argmax(-1))
    assert torch.equal(greedy_lp_B, logits_BV.log_softmax(-1).gather(1, greedy_B[:, None])[:, 0])


def test_prompt_streams_are_per_prompt_and_prefix_stable():
    steps = STREAM_CHUNK_STEPS + 20  # crosses a chunk boundary
    both = PromptStreams([5, 8], n=3, max_steps=steps, device=torch.device("cpu"))
    alone = PromptStreams([8], n=3, max_steps=STREAM_CHUNK_STEPS - 1, device=torch.device("cpu"))
    draws_TR = torch.stack([both.uniforms(t) for t in range(steps)])
    assert draws_TR.shape == (steps, 6) and draws_TR.dtype == torch.float64
    # prompt 1's draws are its generator's stream read as [step, sample]; a shorter decode reads a prefix
    want = torch.rand(steps, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    assert torch.equal(draws_TR[:, 3:], want)
    assert torch.equal(torch.stack([alone.uniforms(t) for t in range(STREAM_CHUNK_STEPS - 1)]),
                       want[:STREAM_CHUNK_STEPS - 1])
    assert not torch.equal(draws_TR[:, :3], draws_TR[:, 3:])
