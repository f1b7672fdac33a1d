"""Choosing the next token of every row of a batched decode step for the HF rollout engine: CTRL's repetition
penalty, temperature and top-p (computed as transformers' logits processors compute them), then a draw from the
row's prompt's own random stream, so a row's token depends only on its own logits and its prompt's seed.

Pure functions over tensors plus the per-prompt streams; nothing here knows models, caches or the batch layout.
Shapes: B rows of the batch, V vocabulary entries (the model's output width), P prompts, N samples per prompt
(a prompt's rows are contiguous: row p * N + k is its sample k), C decode steps of one chunk of a stream.
"""

from __future__ import annotations

import torch

STREAM_CHUNK_STEPS = 64  # decode steps of uniforms drawn per prompt at a time


def penalize_repeats(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty, as transformers' `RepetitionPenaltyLogitsProcessor`: the logit of a token already
    in the row's prompt or response (`seen_BV`, bool) is divided by `penalty` where positive, multiplied where
    negative; other logits are unchanged."""
    penalized_BV = torch.where(logits_BV < 0, logits_BV * penalty, logits_BV / penalty)
    return torch.where(seen_BV, penalized_BV, logits_BV)


def top_p_filter(scores_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' `TopPLogitsWarper` (min_tokens_to_keep 1): -inf on every token outside the smallest set of
    most likely ones whose probability reaches `top_p`."""
    sorted_BV, order_BV = torch.sort(scores_BV, descending=False)
    remove_sorted_BV = sorted_BV.softmax(-1).cumsum(-1) <= 1 - top_p
    remove_sorted_BV[:, -1] = False
    remove_BV = remove_sorted_BV.scatter(1, order_BV, remove_sorted_BV)
    return scores_BV.masked_fill(remove_BV, float("-inf"))


def draw_tokens(probs_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the token whose interval of the cumulative distribution holds u * total
    (`uniforms_B` float64 in [0, 1)). A token of probability zero is never drawn. Returns tokens_B (int64)."""
    cdf_BV = probs_BV.double().cumsum(-1)
    target_B1 = uniforms_B[:, None].to(cdf_BV) * cdf_BV[:, -1:]
    tokens_B = torch.searchsorted(cdf_BV, target_B1, right=True)[:, 0]
    # u * total may round up to total: then the last token of non-zero probability is meant
    vocab = probs_BV.shape[-1]
    last_B = vocab - 1 - (probs_BV > 0).flip(-1).int().argmax(-1)
    return torch.minimum(tokens_B, last_B)


def next_tokens(logits_BV: torch.Tensor, *, temperature: float, top_p: float, repetition_penalty: float,
                seen_BV: torch.Tensor | None, uniforms_B: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's tokens and their log-probs from raw float32 logits.

    Greedy (temperature 0): the argmax after the repetition penalty. Sampling: penalty, then / temperature, then
    top-p (skipped at 1.0, as transformers does), then a draw with `uniforms_B`. The log-prob is
    log_softmax(logits / temperature) (temperature 1 when greedy) of the chosen token, before the penalty and
    top-p: what the actor computes for the same token. `seen_BV` is needed when the penalty is not 1,
    `uniforms_B` when sampling. Returns (tokens_B int64, logprobs_B float32)."""
    scores_BV = logits_BV
    if repetition_penalty != 1.0:
        assert seen_BV is not None, "the repetition penalty needs the tokens each row has seen"
        scores_BV = penalize_repeats(scores_BV, seen_BV, repetition_penalty)
    if temperature == 0:
        tokens_B = scores_BV.argmax(-1)
        logprobs_BV = logits_BV.log_softmax(-1)
    else:
        assert uniforms_B is not None, "sampling needs a uniform draw per row"
        scores_BV = scores_BV / temperature
        if top_p < 1.0:
            scores_BV = top_p_filter(scores_BV, top_p)
        tokens_B = draw_tokens(scores_BV.softmax(-1), uniforms_B)
        logprobs_BV = (logits_BV / temperature).log_softmax(-1)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None])[:, 0]


class PromptStreams:
    """Uniforms in [0, 1) (float64) for the N rows of each of P prompts, each prompt from its own CPU
    `torch.Generator` seeded with its request seed: draw t * N + k of prompt p is its sample k's at decode step t.
    So a prompt's draws do not depend on the other prompts of the batch, the device, or `max_steps` (chunks of
    steps are drawn one after the other from the same generator, which concatenates to one stream)."""

    def __init__(self, seeds: list[int], n: int, max_steps: int, device: torch.device) -> None:
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.n, self.max_steps, self.device = n, max_steps, device
        self.start = 0
        self.chunk_CB = torch.empty(0, len(seeds) * n, dtype=torch.float64)

    def uniforms(self, step: int) -> torch.Tensor:
        """The P * N uniforms of decode step `step` (row order). Steps are asked for in increasing order."""
        if step >= self.start + len(self.chunk_CB):
            assert step == self.start + len(self.chunk_CB), "decode steps are drawn in order"
            steps = min(STREAM_CHUNK_STEPS, self.max_steps - step)
            draws = [torch.rand(steps, self.n, generator=g, dtype=torch.float64) for g in self.generators]
            self.start, self.chunk_CB = step, torch.cat(draws, dim=1).to(self.device)
        return self.chunk_CB[step - self.start]
