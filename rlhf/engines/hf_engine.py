"""Fallback rollout engine on `transformers.generate`, used when vLLM is not installed.

Same interface as the vLLM engine. Slower and without tensor parallelism: every rank is its own
engine. Log-probs are log_softmax(logits / temperature) of the sampled tokens, matching the actor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlhf.engines.rollout import Generation, SamplingSpec
from rlhf.models.loading import load_causal_lm


class HFGenerateEngine:
    """`RolloutEngine` backed by a private copy of the policy and `model.generate`."""

    def __init__(self, model_path: str, *, dtype: torch.dtype, device: torch.device, eos_token_id: int,
                 pad_token_id: int, attn_implementation: str = "sdpa", trust_remote_code: bool = False) -> None:
        self.model = load_causal_lm(model_path, dtype, attn_implementation, trust_remote_code).to(device).eval()
        self.device = device
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def _generate_one(self, prompt: list[int], spec: SamplingSpec) -> list[Generation]:
        input_ids = torch.tensor([prompt] * spec.n, device=self.device)
        greedy = spec.temperature == 0
        sampling = {} if greedy else dict(temperature=spec.temperature, top_p=spec.top_p, top_k=0)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=not greedy, **sampling,
            repetition_penalty=spec.repetition_penalty, max_new_tokens=spec.max_tokens,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, use_cache=True,
            output_logits=True, return_dict_in_generate=True,
        )
        new_BT = out.sequences[:, len(prompt):]
        logprobs_BT = torch.stack(out.logits, dim=1).float().div(1.0 if greedy else spec.temperature).log_softmax(-1)
        picked_BT = logprobs_BT.gather(-1, new_BT[:, :, None]).squeeze(-1)
        gens = []
        for b in range(spec.n):
            ids = new_BT[b].tolist()
            stop = ids.index(self.eos_token_id) + 1 if self.eos_token_id in ids else len(ids)
            reason = "stop" if stop < len(ids) or (ids and ids[-1] == self.eos_token_id) else "length"
            gens.append(Generation(ids[:stop], picked_BT[b, :stop].tolist(), reason))
        return gens

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[list[Generation]]:
        assert len(seeds) == len(prompts), "one seed per prompt"
        # `model.generate` samples from torch's global RNG (it takes no generator): re-seed it per prompt,
        # so each prompt draws its own stream, and restore the caller's RNG state afterwards.
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            gens = []
            for prompt, seed in zip(prompts, seeds):
                torch.manual_seed(seed)
                gens.append(self._generate_one(prompt, spec))
            return gens

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].dtype))

    def sleep(self) -> None:
        """Nothing to release: the HF engine keeps no KV cache between calls."""

    def wake_up(self) -> None:
        """Nothing to restore (see sleep)."""
