"""The RL loop of `train_ppo`: PPO (GAE + critic), REINFORCE++, REINFORCE++-baseline, RLOO, GRPO
and Dr.GRPO share it.

One step: generate (every rank's engine) -> gather the global batch -> make experience (each role on
its ranks) -> train actor || train critic (each on its ranks, concurrently when disjoint) -> sync the
actor's weights into every engine -> log. Per-role work lives in the role objects.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlhf.config.common import CheckpointConfig
from rlhf.config.ppo import TrainPPOConfig
from rlhf.data.pretrain import PtxData
from rlhf.data.prompts import Prompt, PromptSampler
from rlhf.data.records import Experience, Rollout
from rlhf.distributed.collectives import all_gather_rollout, shard
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel, NonFiniteError
from rlhf.engines.rollout import RolloutEngine, SamplingSpec, request_seed, to_rollout
from rlhf.engines.weight_sync import ParamSpec, broadcast_parameters
from rlhf.models.micro_batches import MicroBatcher
from rlhf.trainers.actor import Actor
from rlhf.trainers.critic import Critic
from rlhf.trainers.experience import ExperienceMaker
from rlhf.utils import watchdog
from rlhf.utils.checkpoint import (
    CheckpointWriter,
    decided_by_rank0,
    load_rank_state,
    load_trainer_state,
    pick_checkpoint,
    prune,
)
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preemption import PreemptionWatch
from rlhf.utils.timers import StageTimer

SHARE_METRICS = ("policy_loss", "clip_frac", "train_kl", "entropy", "ptx_loss", "value_loss")
TRAIN_METRICS = SHARE_METRICS + ("grad_norm", "lr", "critic_grad_norm", "nonfinite_skipped", "critic_nonfinite_skipped")


def total_steps(cfg: TrainPPOConfig, sampler: PromptSampler) -> int:
    steps = sampler.steps_per_episode * cfg.batch.num_episodes
    return min(steps, cfg.batch.max_steps) if cfg.batch.max_steps else steps


@dataclass
class Roles:
    """What this rank hosts (None where it does not) and what every rank needs for weight sync."""

    actor: Actor | None
    critic: Critic | None
    experience: ExperienceMaker
    actor_specs: list[ParamSpec]
    ptx: PtxData | None = None
    frozen: list[DeepSpeedModel] = field(default_factory=list)

    @property
    def trainable(self) -> list[DeepSpeedModel]:
        return [r.model for r in (self.actor, self.critic) if r is not None]


class PPOTrainer:
    """Drives the loop. Construct on every rank with the same config."""

    def __init__(self, cfg: TrainPPOConfig, topology: Topology, roles: Roles, engine: RolloutEngine,
                 sampler: PromptSampler, tokenizer, logger: MetricsLogger, device: torch.device) -> None:
        self.cfg, self.topology, self.roles, self.engine = cfg, topology, roles, engine
        self.sampler, self.tokenizer, self.logger, self.device = sampler, tokenizer, logger, device
        self.timer = StageTimer()

    def fit(self, start_step: int = 0, preemption: PreemptionWatch | None = None) -> bool:
        """Run steps until the end (True) or until a preemption signal, after checkpointing (False)."""
        save_steps = self.cfg.checkpoint.save_steps
        for step in range(start_step, total_steps(self.cfg, self.sampler)):
            watchdog.set_step(step + 1)
            with self.timer.stage("step"):
                try:
                    metrics = self.step(step)
                except NonFiniteError as err:  # name the training step too, not only the role's optimizer step
                    raise NonFiniteError(f"training step {step + 1}, {err}") from None
            metrics.update(self.timer.pop())
            if (step + 1) % self.cfg.logging.logging_steps == 0:
                self.logger.log(step + 1, metrics)
            self.logger.advance(metrics)
            saved = save_steps > 0 and (step + 1) % save_steps == 0
            if saved:
                with watchdog.stage("checkpoint"):
                    self.save_checkpoint(step + 1)
            if preemption is not None and preemption.should_stop():
                if not saved:
                    with watchdog.stage("checkpoint"):
                        self.save_checkpoint(step + 1)
                if self.topology.rank == 0:
                    print(f"preempted: checkpoint after step {step + 1} written, exiting", flush=True)
                return False
        return True

    def save_checkpoint(self, done_steps: int) -> str:
        """Everything needed to continue after `done_steps` steps (collective over the world)."""
        c, rank = self.cfg.checkpoint, self.topology.rank
        writer = CheckpointWriter(c.ckpt_path, done_steps, is_writer=rank == 0)
        tmp = writer.begin()
        for name, role in (("actor", self.roles.actor), ("critic", self.roles.critic)):
            if role is not None and not c.disable_ds_ckpt:
                with writer.writing(f"the {name}'s DeepSpeed state"):
                    role.model.save_state(os.path.join(tmp, name))
        if c.save_hf_ckpt and self.roles.actor is not None:
            with writer.writing("the actor in HF format"):
                self.roles.actor.model.save_hf(os.path.join(tmp, "hf"), self.tokenizer,
                                               self.topology.leads(Role.ACTOR))
        writer.save_rank_state(rank)
        exp = self.roles.experience
        writer.save_trainer_state({"step": done_steps, "world_size": self.topology.world_size,
                                   "kl_ctl": exp.kl_ctl.state_dict(), "reward_stats": exp.reward_stats.state_dict(),
                                   "has_engine_states": not c.disable_ds_ckpt,
                                   # equal on every actor rank, and rank 0 (the writer) always hosts the actor
                                   "ptx": self.roles.ptx.state_dict() if self.roles.ptx is not None else None})
        final = writer.commit()
        if rank == 0:
            prune(c.ckpt_path, c.max_ckpt_num, c.max_ckpt_mem)
        dist.barrier()
        return final

    def resume(self) -> int:
        """Load the newest intact checkpoint when --load_checkpoint is set (or torchrun restarted the workers);
        returns the steps done. Rank 0 removes stale temporary checkpoints, picks the checkpoint (verified
        against its manifest) and lines metrics.jsonl up with it, then broadcasts the choice (or its error),
        so every rank loads the same checkpoint or raises the same error. Collective over the world."""
        c = self.cfg.checkpoint
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        resuming = c.load_checkpoint or restarted

        def pick() -> tuple[int, str | None]:
            done, path, notes = pick_checkpoint(c.ckpt_path, resuming=resuming, restarted=restarted,
                                                explicit_path=c.ckpt_path != CheckpointConfig().ckpt_path)
            for note in filter(None, [*notes, self.logger.continue_from(done, resuming)]):
                print(note, flush=True)
            return done, path

        done, path = decided_by_rank0(pick, self.topology.rank)
        if path is None:
            return 0
        state = load_trainer_state(path)
        if state["world_size"] != self.topology.world_size or not state["has_engine_states"]:
            raise ValueError(f"checkpoint {path} cannot be resumed exactly: written by {state['world_size']} ranks "
                             f"(now {self.topology.world_size}), engine states saved: {state['has_engine_states']}")
        for name, role in (("actor", self.roles.actor), ("critic", self.roles.critic)):
            if role is not None:
                try:
                    role.model.load_state(os.path.join(path, name))
                except (OSError, RuntimeError) as err:
                    raise ValueError(f"loading {os.path.join(path, name)} (the {name}'s DeepSpeed state) failed: "
                                     f"{err}") from err
        self.roles.experience.kl_ctl.load_state_dict(state["kl_ctl"])
        self.roles.experience.reward_stats.load_state_dict(state["reward_stats"])
        if self.roles.ptx is not None and state.get("ptx") is not None:
            self.roles.ptx.load_state_dict(state["ptx"])
        load_rank_state(path, self.topology.rank)
        if self.topology.rank == 0:
            print(f"resumed from {path} after {done} steps", flush=True)
        return done

    def step(self, step: int) -> dict[str, float]:
        """One RL step. Hybrid-engine transitions (sleep/offload) all happen here, around the stages."""
        e = self.cfg.engine
        with self.timer.stage("generation"):
            local = self.generate(step)
            self.engine.sleep()  # vLLM frees its memory until the next weight push
        with self.timer.stage("experience"):
            self._move(self.roles.frozen, to_host=False, enabled=e.ref_reward_offload)
            experience, metrics = self.roles.experience.make(all_gather_rollout(local, self.tokenizer.pad_token_id))
            self._move(self.roles.frozen, to_host=True, enabled=e.ref_reward_offload)
        train_actor = step >= self.cfg.algo.freezing_actor_steps
        with self.timer.stage("train"):
            self._move(self.roles.trainable, to_host=False, enabled=e.deepspeed_enable_sleep and step > 0)
            metrics.update(self.train(experience, step, train_actor))
            self._move(self.roles.trainable, to_host=True, enabled=e.deepspeed_enable_sleep)
        with self.timer.stage("weight_sync"):
            self.engine.wake_up()
            if train_actor or self.cfg.rollout.vllm_enable_sleep:  # sleep level 2 dropped the weights
                self.sync_weights()
        return metrics

    def _move(self, models: list[DeepSpeedModel], to_host: bool, enabled: bool) -> None:
        for model in models if enabled else []:
            model.offload() if to_host else model.reload(self.device)

    def _engine_prompts(self, step: int) -> tuple[list[Prompt], list[int], int]:
        """Prompts for this rank's engine, their sampling seeds, and the index of this rank's share within
        them. A prompt's seed depends only on (run seed, step, its index in the step's global batch): the
        ranks of one engine get the same seeds, and the samples do not depend on the number of engines."""
        batch = self.sampler.batch(step)
        per_engine = len(batch) // self.topology.num_engines
        first = self.topology.engine_index * per_engine
        seeds = [request_seed(self.cfg.seed, step, i) for i in range(first, first + per_engine)]
        return batch[first:first + per_engine], seeds, self.topology.engine_rank

    def generate(self, step: int) -> Rollout:
        """Sample n responses per prompt on this rank's engine; keep this rank's share of prompts."""
        prompts, seeds, share = self._engine_prompts(step)
        r = self.cfg.rollout
        spec = SamplingSpec(n=r.n_samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                            max_tokens=r.generate_max_len)
        generations = self.engine.generate([list(p.token_ids) for p in prompts], spec, seeds)
        per_rank = len(prompts) // self.topology.rollout_tp
        keep = slice(share * per_rank, (share + 1) * per_rank)
        prompts, generations = prompts[keep], generations[keep]
        return to_rollout([list(p.token_ids) for p in prompts], generations, self.tokenizer.pad_token_id,
                          self.tokenizer, [p.text for p in prompts], [p.label for p in prompts])

    def _optimizer_batches(self, exp: Experience, role: Role, batcher: MicroBatcher, step: int,
                           epoch: int) -> list[list[Experience]]:
        """This replica's shard, shuffled, cut into optimizer steps of micro-batches (the ranks of a ring
        get the same ones: the shuffle seed is the data-parallel rank)."""
        dp, rank = self.topology.dp_size(role), self.topology.dp_rank(role)
        mine = exp.select(shard(exp.num_samples, dp, rank))
        order = list(range(mine.num_samples))
        random.Random(((self.cfg.seed * 100_003 + step) * 101 + epoch) * 4099 + rank).shuffle(order)
        mine = mine.select(torch.tensor(order))
        per_step = self.cfg.batch.train_batch_size // dp
        steps = [mine.slice(start, start + per_step) for start in range(0, mine.num_samples, per_step)]
        return [[part.select(torch.tensor(rows)).trimmed() for rows in batcher.split(part.attention_mask_BT)]
                for part in steps]

    def train(self, exp: Experience, step: int, train_actor: bool) -> dict[str, float]:
        """max_epochs passes; actor and critic each on their own ranks. Metrics are global."""
        actor_stats: dict[str, float] = {}
        critic_stats: dict[str, float] = {}
        for epoch in range(self.cfg.batch.max_epochs):
            actor, critic = self.roles.actor, self.roles.critic
            if actor is not None and train_actor:
                for micro in self._optimizer_batches(exp, Role.ACTOR, actor.train_batcher, step, epoch):
                    _accumulate(actor_stats, actor.train_batch(micro, self.roles.experience.kl_ctl.value,
                                                               self.roles.ptx))
            if critic is not None:
                for micro in self._optimizer_batches(exp, Role.CRITIC, critic.train_batcher, step, epoch):
                    _accumulate(critic_stats, critic.train_batch(micro))
        return self._global_train_metrics(actor_stats, critic_stats)

    def _global_train_metrics(self, actor: dict[str, float], critic: dict[str, float]) -> dict[str, float]:
        """Per-update averages over the world: loss terms are summed over a role's ranks (each holds its
        share); norms and the LR are taken from the role's first rank."""
        contrib: dict[str, float] = {}
        for role, stats in ((Role.ACTOR, actor), (Role.CRITIC, critic)):
            if stats:
                updates = stats.pop("_updates")
                undeclared = sorted(set(stats) - set(TRAIN_METRICS))
                if undeclared:  # a metric nobody reduces would silently vanish from the logs
                    raise RuntimeError(f"{role.value} produced metrics {undeclared} with no declared reduction: "
                                       "add them to SHARE_METRICS (summed shares) or TRAIN_METRICS (lead rank)")
                first = self.topology.leads(role)
                shares = self.topology.ring_rank(role) == 0  # the ranks of a ring report the same loss
                contrib.update({k: v / updates for k, v in stats.items()
                                if (k in SHARE_METRICS and shares) or first})
        values = torch.tensor([contrib.get(k, 0.0) for k in TRAIN_METRICS]
                              + [float(k in contrib) for k in TRAIN_METRICS], dtype=torch.float64)
        dist.all_reduce(values)
        n = len(TRAIN_METRICS)
        return {k: float(values[i]) for i, k in enumerate(TRAIN_METRICS) if values[n + i] > 0}

    def sync_weights(self) -> None:
        """Push the actor's weights into every rank's engine (collective over the world)."""
        actor = self.roles.actor
        if len(self.topology.ranks(Role.ACTOR)) == self.topology.world_size:
            self.engine.load_weights(actor.model.full_parameters())
            return
        local = actor.model.full_parameters() if actor is not None else None
        self.engine.load_weights(broadcast_parameters(
            local, self.roles.actor_specs, src=self.topology.ranks(Role.ACTOR)[0],
            bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20, device=self.device))


def _accumulate(total: dict[str, float], stats: dict[str, float]) -> None:
    for k, v in stats.items():
        total[k] = total.get(k, 0.0) + v
    total["_updates"] = total.get("_updates", 0.0) + 1.0
