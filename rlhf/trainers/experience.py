"""Making experience from the step's global rollout: each role scores its shard on its own ranks,
the shards are assembled on every rank, then rewards are shaped and advantages computed identically
everywhere (so whitening statistics are those of the whole global batch).

Owns the KL controller and the reward normaliser (their state goes into checkpoints).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.algorithms.advantages import (
    ESTIMATORS,
    discounted_returns,
    gae,
    masked_moments,
    token_rewards,
    whiten,
)
from rlhf.algorithms.kl import KLController, kl_estimate
from rlhf.algorithms.losses import rollout_mismatch_BT1
from rlhf.algorithms.shaping import (
    RunningMoments,
    group_filter,
    overlong_penalty,
    stop_properly_penalty,
)
from rlhf.config.ppo_config import AlgoConfig, BatchConfig, RolloutConfig, Schedule
from rlhf.data.records import Experience, Rollout
from rlhf.distributed.collectives import assemble, broadcast_keys, shard
from rlhf.distributed.topology import Role, Topology
from rlhf.models.micro_batches import MicroBatcher
from rlhf.rewards.base import RewardInputs, RewardResult, RewardSource
from rlhf.trainers.actor import Actor, batched_logprobs
from rlhf.trainers.critic import Critic
from rlhf.utils.preemption import CutShort, interruptible


def actor_forward_skippable(b: BatchConfig, algo: AlgoConfig, schedule: Schedule) -> bool:
    """Whether the experience-time actor forward can be skipped: the step's batch feeds exactly one optimizer
    step of the actor (--max_epochs 1, --rollout_batch_size x --n_samples_per_prompt == --train_batch_size, the
    actor trained from the first step), and nothing before training reads the actor's log-probs (no reference
    model: its KL shapes rewards and its metric is the actor's). Then the old log-probs are the training
    forward's own, detached (the ratio is exactly 1), and the rollout-mismatch metrics come from that forward."""
    one_update = (b.max_epochs == 1 and b.rollout_batch_size * schedule.samples_per_prompt == b.train_batch_size
                  and algo.freezing_actor_steps <= 0)
    return one_update and not algo.needs_ref


@dataclass
class Scored:
    """What the reward sources answered for a global batch, each [B]: the raw rewards, the scores dynamic
    filtering judges groups by (a reward_func's `scores`, else the rewards) and the extra logs (`per_call`: those
    a source gave as one value per call, held by each of the call's samples)."""

    rewards_B: torch.Tensor
    scores_B: torch.Tensor
    extra: dict[str, torch.Tensor]
    per_call: frozenset[str] = frozenset()

    def select(self, indices: list[int]) -> Scored:
        return Scored(self.rewards_B[indices], self.scores_B[indices], {k: v[indices] for k, v in self.extra.items()},
                      self.per_call)

    @staticmethod
    def concat(parts: list[Scored]) -> Scored:
        return Scored(torch.cat([p.rewards_B for p in parts]), torch.cat([p.scores_B for p in parts]),
                      {k: torch.cat([p.extra[k] for p in parts]) for k in parts[0].extra},
                      frozenset().union(*(p.per_call for p in parts)))


class ExperienceMaker:
    """Built on every rank; roles the rank does not host are None. `skip_actor_forward`: leave the old log-probs
    to the training forward (`actor_forward_skippable`)."""

    def __init__(self, algo: AlgoConfig, rollout: RolloutConfig, schedule: Schedule, topology: Topology, *,
                 actor: Actor | None, critic: Critic | None,
                 ref_model: torch.nn.Module | None, reward: RewardSource | None, device: torch.device,
                 ref_batcher: MicroBatcher | None = None, running_reward_norm: bool | None = None,
                 skip_actor_forward: bool = False) -> None:
        """`schedule`: the job's (`TrainPPOConfig.schedule`: RePULSe's differs); `running_reward_norm`: normalise
        rewards with running statistics (default: --normalize_reward; False when the reward models normalise with
        their stored statistics instead)."""
        self.algo, self.rollout, self.schedule = algo, rollout, schedule
        self.topology, self.device = topology, device
        self.running_reward_norm = algo.normalize_reward if running_reward_norm is None else running_reward_norm
        self.actor, self.critic, self.ref_model, self.reward = actor, critic, ref_model, reward
        self.ref_batcher = ref_batcher
        self.skip_actor_forward = skip_actor_forward
        self.estimator = ESTIMATORS[algo.advantage_estimator]
        self.kl_ctl = KLController(algo.init_kl_coef, algo.kl_target, algo.kl_horizon)
        self.reward_stats = RunningMoments()

    def _by_role(self, role: Role, compute: Callable[[slice | torch.Tensor], torch.Tensor], shape: tuple[int, ...],
                 collective: bool = True, balance: tuple[MicroBatcher | None, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """Rows computed by `role`'s ranks on their shards, assembled on every training rank (collective over
        them: the world, except with --async_train).
        The ranks of a ring hold the same rows: all of them run a `collective` computation (a model
        forward), only the first runs any other (an HTTP call, a reward function); the first contributes.
        `balance` (a model forward's micro-batcher on this rank, the batch's attention mask): with dynamic
        batching each replica's rows are dealt by tokens, as the training step's are (`MicroBatcher.replica_rows`;
        `compute` then gets a tensor of row indices); else each replica computes a contiguous shard."""
        hosts = self.topology.hosts(role)
        first_of_ring = hosts and self.topology.replica_rank(role) == 0
        where: slice | torch.Tensor = slice(0, 0)
        if hosts:
            dp, rank = self.topology.dp_size(role), self.topology.dp_rank(role)
            batcher = balance[0] if balance is not None else None
            if batcher is not None and batcher.max_tokens is not None:
                where = torch.tensor(batcher.replica_rows(balance[1], dp, rank), dtype=torch.long)
            else:
                where = shard(shape[0], dp, rank)
        part = compute(where) if first_of_ring or (hosts and collective) else None
        return assemble(part if first_of_ring else None, where, shape, self.topology.trainer_group)

    def _rewards(self, batch: Rollout) -> Scored:
        B = batch.num_samples
        queries = [p + r for p, r in zip(batch.prompts, batch.responses)]
        results: dict[str, torch.Tensor] = {}

        collective = getattr(self.reward, "collective", False)

        def score(where: slice) -> torch.Tensor:
            inputs = RewardInputs(queries[where], batch.prompts[where], batch.labels[where],
                                  batch.sequences_BT[where], batch.attention_mask_BT[where])
            try:  # a reward function or server call (not a model's collective forward) ends on SIGTERM or Ctrl-C
                with interruptible() if not collective else contextlib.nullcontext():
                    out = self.reward.score(inputs)
            except CutShort:  # stand-in rewards: the step is dropped at the abandon point after the experience
                zeros = torch.zeros(len(inputs.queries))
                out = RewardResult(zeros, zeros.clone())
            results["extra"], results["per_call"] = out.extra_logs, out.per_call
            return torch.stack([out.rewards_B, out.scores_B], dim=1)

        both = self._by_role(Role.REWARD, score, (B, 2), collective)
        src, group = self.topology.ranks(Role.REWARD)[0], self.topology.trainer_group
        keys = broadcast_keys(sorted(results.get("extra", {})), src=src, group=group)
        per_call = broadcast_keys(sorted(results.get("per_call", ())), src=src, group=group) if keys else []
        extra = {k: self._by_role(Role.REWARD, lambda w, k=k: results["extra"].get(k, torch.zeros(len(range(B)[w]))),
                                  (B,), collective)  # zeros: a stand-in result (`CutShort`) has no extra logs
                 for k in keys}
        return Scored(both[:, 0], both[:, 1], extra, frozenset(per_call))

    def _shape_rewards(self, rewards_B: torch.Tensor, batch: Rollout) -> torch.Tensor:
        algo = self.algo
        if algo.overlong_buffer_len is not None:
            rewards_B = rewards_B + overlong_penalty(batch.response_lens_B, self.rollout.generate_max_len,
                                                     algo.overlong_buffer_len, algo.overlong_penalty_factor)
        if algo.stop_properly_penalty_coef is not None:
            truncated = torch.tensor([f == "length" for f in batch.finish_reasons])
            rewards_B = stop_properly_penalty(rewards_B, truncated, algo.stop_properly_penalty_coef)
        if self.running_reward_norm:
            r = rewards_B.double()
            self.reward_stats.update(float(r.sum()), float((r * r).sum()), r.numel())
            rewards_B = self.reward_stats.normalize(rewards_B)
        if algo.reward_clip_range is not None:
            rewards_B = rewards_B.clamp(*algo.reward_clip_range)
        return rewards_B

    def gather(self, role: Role, compute: Callable[[slice], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """Rows of a global batch computed by `role`'s ranks on their shards (a model forward: every rank of a
        ring runs it), assembled on every rank. Collective over the world."""
        return self._by_role(role, compute, shape)

    def _logprobs(self, batch: Rollout, with_ref: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(actor log-probs, reference log-probs or None), float32 [B, T-1] on every rank. Collective."""
        B, T = batch.sequences_BT.shape
        seq, mask = batch.sequences_BT, batch.attention_mask_BT
        old = self._by_role(Role.ACTOR, lambda w: self.actor.logprobs(seq[w], mask[w]), (B, T - 1),
                            balance=(self.actor.infer_batcher if self.actor is not None else None, mask))
        if not with_ref:
            return old, None
        temperature = self.rollout.temperature
        ref = self._by_role(Role.REF, lambda w: batched_logprobs(self.ref_model, seq[w], mask[w], self.ref_batcher,
                                                                 temperature, self.device), (B, T - 1),
                            balance=(self.ref_batcher, mask))
        return old, ref

    def score(self, batch: Rollout, with_ref: bool, rm_max_len: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(raw rewards [B], actor log-probs [B, T-1], reference log-probs [B, T-1] or None) of a global batch,
        identical on every rank; nothing shaped, no advantages (for a step that computes its own). `rm_max_len`:
        reward models see only each sample's first that many tokens. Collective."""
        old, ref = self._logprobs(batch, with_ref)
        return self._rewards(_truncated(batch, rm_max_len)).rewards_B, old, ref

    def rewards(self, batch: Rollout, rm_max_len: int | None = None) -> torch.Tensor:
        """The reward sources' raw rewards [B] of a global batch, on every rank (no log-probs). Collective."""
        return self._rewards(_truncated(batch, rm_max_len)).rewards_B

    def scored(self, batch: Rollout, rm_max_len: int | None = None) -> Scored:
        """The reward sources' answer for a global batch (rewards, the scores dynamic filtering judges groups by,
        extra logs), on every rank; `make` takes it back so no sample is scored twice. Collective."""
        return self._rewards(_truncated(batch, rm_max_len))

    def make(self, batch: Rollout, rm_max_len: int | None = None, scored: Scored | None = None
             ) -> tuple[Experience, dict[str, float]]:
        """Experience for the whole global batch (identical on every rank) and step metrics. `rm_max_len`:
        reward models see only each sample's first that many tokens. `scored`: the batch's rewards when they
        were already asked for (dynamic filtering), else the reward sources are asked now."""
        B, T = batch.sequences_BT.shape
        seq, mask = batch.sequences_BT, batch.attention_mask_BT
        with_ref = self.ref_model is not None or Role.REF in self.topology.plan
        old, ref = (None, None) if self.skip_actor_forward and not with_ref else self._logprobs(batch, with_ref)
        values = None
        if Role.CRITIC in self.topology.plan:
            values = self._by_role(Role.CRITIC, lambda w: self.critic.values(seq[w], mask[w]), (B, T - 1),
                                   balance=(self.critic.infer_batcher if self.critic is not None else None, mask))
        scored = scored or self._rewards(_truncated(batch, rm_max_len))
        raw_rewards, scores, extra = scored.rewards_B, scored.scores_B, scored.extra
        rewards = self._shape_rewards(raw_rewards, batch)
        action = batch.action_mask_BT1
        n = self.schedule.samples_per_prompt
        if self.algo.dynamic_filtering:
            keep = group_filter(scores.reshape(-1, n), *self.algo.dynamic_filtering_reward_range)
            action = action * keep.repeat_interleave(n)[:, None].float()
        kl = kl_estimate(old, ref, self.algo.kl_estimator) * action if ref is not None else None
        advantages, returns = self._advantages(rewards, action, kl, values, n)
        metrics = self._metrics(batch, raw_rewards, rewards, extra, kl, action)
        metrics["return_mean"] = _token_mean(returns, action)
        metrics["advantage_mean"] = _token_mean(advantages, action)
        if old is not None:  # else the training forward reports them (Actor.train_batch)
            metrics.update(self._rollout_mismatch(old, batch.rollout_logprobs_BT1, action))
        if kl is not None:
            kept = int((action.sum(-1) > 0).sum())  # filtered groups do not move the controller
            self.kl_ctl.update(metrics["kl"], kept)
        exp = Experience(seq, mask, action, old, batch.rollout_logprobs_BT1, advantages, rewards, ref, values,
                         returns if values is not None else None, raw_rewards)
        return exp, metrics

    def _rollout_mismatch(self, old: torch.Tensor, rollout: torch.Tensor, action: torch.Tensor) -> dict[str, float]:
        """How far the engine's log-probs are from the actor's, and what the off-policy correction does."""
        values = rollout_mismatch_BT1(old, rollout, action, self.algo.is_correction)
        return {name: _token_mean(v, action) for name, v in values.items()}

    def _advantages(self, rewards_B: torch.Tensor, action: torch.Tensor, kl: torch.Tensor | None,
                    values: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) per token; for critic-free estimators the returns are the discounted
        sums of the (group-adjusted) token rewards before whitening."""
        algo, est = self.algo, self.estimator
        if est.group_step is not None:
            rewards_B = est.group_step(rewards_B.reshape(-1, n)).reshape(-1)
        kl_in_reward = None if algo.use_kl_loss else kl
        per_token = token_rewards(rewards_B, action, kl_in_reward, self.kl_ctl.value)
        gamma = 1.0 if est.gamma_one else algo.gamma
        if est.needs_critic:
            advantages, returns = gae(per_token, values, action, gamma, algo.lambd)
        else:
            returns = discounted_returns(per_token, action, gamma)
            advantages = returns.clone()
        if est.whiten:
            advantages = whiten(advantages, action, masked_moments(advantages, action),
                                divide_std=not algo.no_advantage_std_norm)
        return advantages, returns

    def _metrics(self, batch: Rollout, raw: torch.Tensor, shaped: torch.Tensor, extra: dict[str, torch.Tensor],
                 kl: torch.Tensor | None, action: torch.Tensor) -> dict[str, float]:
        metrics = {
            "reward_mean": float(raw.mean()),
            "reward_shaped_mean": float(shaped.mean()),
            "response_length": float(batch.response_lens_B.float().mean()),
            "stop_ratio": sum(f == "stop" for f in batch.finish_reasons) / len(batch.finish_reasons),
            "kept_ratio": float((action.sum(-1) > 0).float().mean()),
            "kl_coef": self.kl_ctl.value,
        }
        if kl is not None:  # over the samples that count (filtered groups have no action tokens left)
            kept = action.sum(-1) > 0
            per_seq = kl.sum(-1) / action.sum(-1).clamp(min=1)
            metrics["kl"] = float(per_seq[kept].mean()) if kept.any() else 0.0
        metrics.update({f"reward_extra/{k}": float(v.mean()) for k, v in extra.items()})
        return metrics


def _truncated(batch: Rollout, rm_max_len: int | None) -> Rollout:
    """`batch` with each sample cut to its first `rm_max_len` tokens (what the reward models see)."""
    seq, mask = batch.sequences_BT, batch.attention_mask_BT
    if rm_max_len is None or seq.shape[1] <= rm_max_len:
        return batch
    return dataclasses.replace(batch, sequences_BT=seq[:, :rm_max_len], attention_mask_BT=mask[:, :rm_max_len])


def _token_mean(values_BT1: torch.Tensor, action_BT1: torch.Tensor) -> float:
    return float((values_BT1 * action_BT1).sum() / action_BT1.sum().clamp(min=1))
