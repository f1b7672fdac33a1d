"""The rollout-engine interface, and turning engine outputs into a padded `Rollout` record.

An engine lives on every rank. Engines generate from token ids, report each sampled token's
log-prob, and accept new weights in-process as an iterator of (HF parameter name, tensor) pairs.
Every prompt is sampled from its own seed (`request_seed`), so a prompt's samples depend only on the
run seed, the step and the prompt's place in the step's global batch, not on which engine drew them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf.data.records import Rollout

# Below 2**62: vLLM seeds the k-th of a request's n samples with seed + k, and torch generators take
# seeds below 2**64; -1 means "unseeded" to vLLM, so seeds are never negative.
MAX_REQUEST_SEED = (1 << 62) - 1


def request_seed(run_seed: int, step: int, prompt_index: int, stream: int = 0) -> int:
    """The sampling seed of one prompt: a hash of (run seed, step, index of the prompt in the step's
    global batch), in [0, MAX_REQUEST_SEED]. Hashing (not seed + index) keeps the streams of neighbouring
    prompts and steps unrelated, and it never depends on the engine or rank that samples the prompt. `stream`
    > 0 gives another independent stream for the same prompt (a second model sampling it in the same step)."""
    key = f"rollout:{run_seed}:{step}:{prompt_index}" + (f":{stream}" if stream else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_REQUEST_SEED


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings shared by every prompt of a `generate` call (seeds are per prompt)."""

    n: int
    temperature: float  # 0: greedy
    top_p: float
    max_tokens: int
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or generated (CTRL's penalty)


@dataclass
class Generation:
    """One sample: generated token ids (EOS included when emitted), their log-probs, why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS / stop token) or "length"


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[list[Generation]]:
        """For each prompt, `spec.n` generations drawn from the prompt's own seed (`seeds[i]`, one per
        prompt, in [0, MAX_REQUEST_SEED]): a prompt's random stream depends on its seed, not on the other
        prompts of the batch, and its n samples draw different streams. Ranks of one engine call it with
        identical arguments."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights. The iterator may be lazy; all tensors arrive in this one call."""
        ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


def to_rollout(prompt_ids: list[list[int]], generations: list[list[Generation]], pad_id: int,
               tokenizer, prompts_text: list[str], labels: list) -> Rollout:
    """Pad prompt+response sequences into a `Rollout` (samples of one prompt stay contiguous)."""
    rows: list[tuple[list[int], Generation, str, object]] = []
    for ids, gens, text, label in zip(prompt_ids, generations, prompts_text, labels):
        rows.extend((list(ids), g, text, label) for g in gens)
    length = max(len(ids) + len(g.token_ids) for ids, g, _, _ in rows)
    B = len(rows)
    sequences = torch.full((B, length), pad_id, dtype=torch.long)
    attention = torch.zeros(B, length, dtype=torch.long)
    action = torch.zeros(B, length - 1, dtype=torch.float32)
    rollout_lp = torch.zeros(B, length - 1, dtype=torch.float32)
    for b, (ids, g, _, _) in enumerate(rows):
        p, r = len(ids), len(g.token_ids)
        sequences[b, :p] = torch.tensor(ids)
        sequences[b, p:p + r] = torch.tensor(g.token_ids, dtype=torch.long)
        attention[b, :p + r] = 1
        action[b, p - 1:p - 1 + r] = 1.0
        rollout_lp[b, p - 1:p - 1 + r] = torch.tensor(g.logprobs, dtype=torch.float32)
    return Rollout(
        sequences_BT=sequences, attention_mask_BT=attention, action_mask_BT1=action,
        rollout_logprobs_BT1=rollout_lp,
        prompt_lens_B=torch.tensor([len(ids) for ids, _, _, _ in rows]),
        response_lens_B=torch.tensor([len(g.token_ids) for _, g, _, _ in rows]),
        finish_reasons=[g.finish_reason for _, g, _, _ in rows],
        prompts=[text for _, _, text, _ in rows],
        responses=tokenizer.batch_decode([g.token_ids for _, g, _, _ in rows], skip_special_tokens=True),
        labels=[label for _, _, _, label in rows],
    )
