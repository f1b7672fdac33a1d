"""Evaluation during RL on --eval_dataset (OpenRLHF's): --eval_n_samples_per_prompt samples per held-out
prompt at --eval_temperature, scored by the run's reward source; per data source (the rows' `datasource`
column) pass1, the mean reward, and pass{k}, the mean over prompts of the best of the k samples. Its samples
use their own seed stream, so a run with evaluation trains exactly as one without it."""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from rlhf.config.errors import UsageError
from rlhf.config.ppo_config import RolloutConfig
from rlhf.distributed.collectives import all_gather_rollout
from rlhf.engines.rollout import SamplingSpec

EVAL_STREAM = 20_000
"""The request-seed stream of evaluation samples (training uses 0; other jobs' evaluations use their own)."""


def prompt_unit(topology) -> int:
    """Prompt lists split over the rollout engines in multiples of this: 1 with one rank per engine (engines
    take unequal shares, or none), else engines x tensor-parallel ranks (samples of a prompt stay on a rank)."""
    return 1 if topology.rollout_tp == 1 else topology.num_engines * topology.rollout_tp


def splittable(prompts: list, unit: int, what: str) -> list:
    """The first prompts that split over the rollout engines (a multiple of `unit`; a warning names the ones
    left out)."""
    usable = len(prompts) - len(prompts) % unit
    if usable == 0:
        raise UsageError(f"{what}: {len(prompts)} prompt(s) cannot be split over the rollout engines' {unit} ranks "
                         f"(--vllm_tensor_parallel_size > 1 keeps a prompt's samples on one rank); give at least "
                         f"{unit}")
    if usable < len(prompts):
        warnings.warn(f"{what}: the last {len(prompts) - usable} prompt(s) are not evaluated (the prompts split "
                      f"in multiples of the rollout engines' {unit} ranks)", stacklevel=3)
    return prompts[:usable]


class PromptEvaluator:
    """`period`: steps between evaluations (--eval_steps; -1: only before the first step and after the last)."""

    def __init__(self, r: RolloutConfig, prompts: list, unit: int, period: int, source: str) -> None:
        """`r`: the rollout flags (--eval_n_samples_per_prompt, --eval_temperature, ...); `unit`: `prompt_unit` of
        the run's topology; `source`: where the prompts came from, for errors."""
        self.period = period
        self.prompts = splittable(prompts, unit, source)
        self.spec = SamplingSpec(n=r.eval_n_samples_per_prompt, temperature=r.eval_temperature, top_p=r.top_p,
                                 max_tokens=r.generate_max_len)

    def __call__(self, trainer) -> dict[str, float]:
        local = trainer.generate(trainer.steps_done, stream=EVAL_STREAM, batch=self.prompts, spec=self.spec)
        batch = all_gather_rollout(local, trainer.tokenizer.pad_token_id)
        rewards = trainer.roles.experience.rewards(batch, trainer.rm_max_len).float()
        k = self.spec.n
        assert rewards.numel() == len(self.prompts) * k, "evaluation samples out of step with the prompts"
        return source_metrics(rewards.reshape(len(self.prompts), k), [p.datasource for p in self.prompts])


def source_metrics(rewards_PK: torch.Tensor, sources: list[str]) -> dict[str, float]:
    """Per data source: eval/{source}_pass1 (mean reward) and, with K > 1 samples per prompt,
    eval/{source}_pass{K} (mean over its prompts of the best sample's reward), as OpenRLHF reports them."""
    k = rewards_PK.shape[1]
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        by_source[source].append(i)
    out = {}
    for source, rows in sorted(by_source.items()):
        group = rewards_PK[rows]
        out[f"eval/{source}_pass1"] = float(group.mean())
        if k > 1:
            out[f"eval/{source}_pass{k}"] = float(group.max(dim=1).values.mean())
    return out
