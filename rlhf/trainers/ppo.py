"""The RL loop of `train_ppo` for critic-free estimators (GRPO, REINFORCE++-baseline).

One step: generate -> make experience -> compute advantages -> train -> sync weights -> log.
Every rank runs every stage (all roles are colocated); collectives go over the actor's group.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from rlhf.algorithms.advantages import ESTIMATORS, broadcast_to_tokens, masked_moments, whiten
from rlhf.config.schema import TrainPPOConfig
from rlhf.data.prompts import Prompt, PromptSampler
from rlhf.data.records import Experience, Rollout
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.rollout import RolloutEngine, SamplingSpec, to_rollout
from rlhf.rewards.base import RewardSource
from rlhf.trainers.actor import Actor
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.timers import StageTimer


def total_steps(cfg: TrainPPOConfig, sampler: PromptSampler) -> int:
    steps = sampler.steps_per_episode * cfg.batch.num_episodes
    return min(steps, cfg.batch.max_steps) if cfg.batch.max_steps else steps


class PPOTrainer:
    """Drives the loop. Construct on every rank with the same config."""

    def __init__(self, cfg: TrainPPOConfig, topology: Topology, actor: Actor, engine: RolloutEngine,
                 reward: RewardSource, sampler: PromptSampler, tokenizer, logger: MetricsLogger) -> None:
        self.cfg = cfg
        self.topology = topology
        self.actor = actor
        self.engine = engine
        self.reward = reward
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.logger = logger
        self.timer = StageTimer()
        self.estimator = ESTIMATORS[cfg.algo.advantage_estimator]
        self.group = topology.group(Role.ACTOR)

    def fit(self, start_step: int = 0) -> None:
        for step in range(start_step, total_steps(self.cfg, self.sampler)):
            with self.timer.stage("step"):
                metrics = self.step(step)
            metrics.update(self.timer.pop())
            if (step + 1) % self.cfg.logging.logging_steps == 0:
                self.logger.log(step + 1, metrics)
            self.logger.advance(metrics)

    def step(self, step: int) -> dict[str, float]:
        with self.timer.stage("generation"):
            rollout = self.generate(step)
        with self.timer.stage("experience"):
            experience, metrics = self.make_experience(rollout)
        with self.timer.stage("train"):
            metrics.update(self.train(experience, step))
        with self.timer.stage("weight_sync"):
            self.engine.load_weights(self.actor.model.full_parameters())
        return metrics

    def _engine_prompts(self, step: int) -> tuple[list[Prompt], int]:
        """Prompts for this rank's engine, and the index of this rank's share within them."""
        batch = self.sampler.batch(step)
        per_engine = len(batch) // self.topology.num_engines
        e = self.topology.engine_index
        return batch[e * per_engine:(e + 1) * per_engine], self.topology.engine_rank

    def generate(self, step: int) -> Rollout:
        """Sample n responses per prompt on this rank's engine; keep this rank's share of prompts."""
        prompts, share = self._engine_prompts(step)
        r = self.cfg.rollout
        spec = SamplingSpec(n=r.n_samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                            max_tokens=r.generate_max_len,
                            seed=(self.cfg.seed * 1_000_003 + step) * 4099 + self.topology.engine_index)
        self.engine.wake_up()
        generations = self.engine.generate([list(p.token_ids) for p in prompts], spec)
        self.engine.sleep()
        per_rank = len(prompts) // self.topology.rollout_tp
        keep = slice(share * per_rank, (share + 1) * per_rank)
        prompts, generations = prompts[keep], generations[keep]
        return to_rollout([list(p.token_ids) for p in prompts], generations, self.tokenizer.pad_token_id,
                          self.tokenizer, [p.text for p in prompts], [p.label for p in prompts])

    def make_experience(self, rollout: Rollout) -> tuple[Experience, dict[str, float]]:
        """Rewards, experience-time log-probs and advantages for this rank's samples."""
        queries = [p + resp for p, resp in zip(rollout.prompts, rollout.responses)]
        scored = self.reward.score(queries, rollout.prompts, rollout.labels)
        old_logprobs = self.actor.logprobs(rollout.sequences_BT, rollout.attention_mask_BT,
                                           self.cfg.batch.micro_rollout_batch_size)
        n = self.cfg.rollout.n_samples_per_prompt
        scores_B = self.estimator.group_step(scored.rewards_B.reshape(-1, n)).reshape(-1)
        advantages = broadcast_to_tokens(scores_B, rollout.action_mask_BT1)
        if self.estimator.whiten:
            moments = masked_moments(advantages, rollout.action_mask_BT1)
            dist.all_reduce(moments, group=self.group)
            advantages = whiten(advantages, rollout.action_mask_BT1, moments,
                                divide_std=not self.cfg.algo.no_advantage_std_norm)
        experience = Experience(rollout.sequences_BT, rollout.attention_mask_BT, rollout.action_mask_BT1,
                                old_logprobs, advantages, scored.rewards_B)
        metrics = self._global_means({
            "reward_mean": scored.rewards_B,
            "response_length": rollout.response_lens_B.float(),
            "stop_ratio": torch.tensor([float(f == "stop") for f in rollout.finish_reasons]),
            **{f"reward_extra/{k}": v for k, v in scored.extra_logs.items()},
        })
        return experience, metrics

    def _global_means(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        keys = sorted(values)
        sums = torch.tensor([[float(values[k].sum()), float(values[k].numel())] for k in keys], dtype=torch.float64)
        dist.all_reduce(sums, group=self.group)
        return {k: float(s / c) for k, (s, c) in zip(keys, sums.tolist())}

    def train(self, experience: Experience, step: int) -> dict[str, float]:
        """`max_epochs` passes over the experience in optimizer steps of `train_batch_size` samples."""
        b = self.cfg.batch
        dp = self.topology.dp_size(Role.ACTOR)
        per_step = b.train_batch_size // dp
        totals: dict[str, float] = {}
        num_updates = 0
        for epoch in range(b.max_epochs):
            order = list(range(experience.num_samples))
            random.Random(((self.cfg.seed * 100_003 + step) * 101 + epoch) * 4099 + self.topology.rank).shuffle(order)
            shuffled = _select(experience, order)
            for start in range(0, experience.num_samples, per_step):
                micro = [shuffled.slice(s, s + b.micro_train_batch_size)
                         for s in range(start, start + per_step, b.micro_train_batch_size)]
                stats = self.actor.train_batch(micro)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                num_updates += 1
        summed = torch.tensor([totals["policy_loss"], totals["clip_frac"], totals["approx_kl"]], dtype=torch.float64)
        dist.all_reduce(summed, group=self.group)
        loss, clip, kl = (summed / num_updates).tolist()
        return {"policy_loss": loss, "clip_frac": clip, "approx_kl": kl,
                "grad_norm": totals["grad_norm"] / num_updates, "lr": stats["lr"]}


def _select(exp: Experience, order: list[int]) -> Experience:
    idx = torch.tensor(order)
    return Experience(exp.sequences_BT[idx], exp.attention_mask_BT[idx], exp.action_mask_BT1[idx],
                      exp.old_logprobs_BT1[idx], exp.advantages_BT1[idx], exp.rewards_B[idx])
