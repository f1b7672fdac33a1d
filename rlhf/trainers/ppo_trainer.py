"""The RL loop of `train_ppo`: PPO (GAE + critic), REINFORCE++, REINFORCE++-baseline, RLOO, GRPO
and Dr.GRPO share it.

One step: generate (every rank's engine) -> gather the global batch -> make experience (each role on
its ranks) -> train actor || train critic (each on its ranks, concurrently when disjoint) -> sync the
actor's weights into every engine -> log. Per-role work lives in the role objects.
"""

from __future__ import annotations

import collections
import copy
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlhf.agents import Agent, TurnLimits, run_episodes
from rlhf.algorithms.shaping import group_filter
from rlhf.config.ppo_config import BatchConfig, Schedule, TrainPPOConfig
from rlhf.core.metrics import Reduce, add_update, per_update_means, reduce_metrics
from rlhf.core.state import CheckpointedState
from rlhf.core.throughput import count_generated, shape_of_pretrained
from rlhf.data.pretrain import PtxData
from rlhf.data.prompts import Prompt, PromptSampler
from rlhf.data.records import Experience, Rollout
from rlhf.distributed.collectives import (
    all_gather_rollout,
    concat_rollouts,
    select_rollout,
)
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.engines.rollout import RolloutEngine, SamplingSpec, request_seed, to_rollout
from rlhf.engines.weight_sync import ParamSpec, broadcast_parameters
from rlhf.models.micro_batches import MicroBatcher
from rlhf.trainers.actor import Actor
from rlhf.trainers.critic import Critic
from rlhf.trainers.experience import ExperienceMaker, Scored
from rlhf.trainers.run_records import RunRecords
from rlhf.utils.checkpoint_files import rng_state, set_rng_state
from rlhf.utils.preemption import abandon_point, abandonable, hurry_agreed
from rlhf.utils.timers import StageTimer

TRAIN_METRICS = {
    **dict.fromkeys(("policy_loss", "clip_frac", "log_ratio_clamp_frac", "train_kl", "entropy", "ptx_loss",
                     "value_loss"), Reduce.SHARE),
    # measured by the training forward when the experience step skips the actor's (actor_forward_skippable)
    **dict.fromkeys(("rollout/logprob_abs_diff", "rollout/is_weight_mean", "rollout/is_clipped_frac"), Reduce.SHARE),
    **dict.fromkeys(("grad_norm", "lr", "critic_grad_norm", "nonfinite_skipped", "critic_nonfinite_skipped"),
                    Reduce.LEAD),
}
"""How the actor's and critic's training metrics combine over their ranks (per-update means)."""


def total_steps(schedule: Schedule, batch: BatchConfig, sampler: PromptSampler) -> int:
    """RL steps of the run: episodes x steps per episode, at most --max_steps."""
    steps = sampler.steps_per_episode * schedule.episodes
    return min(steps, batch.max_steps) if batch.max_steps else steps


REFILL_STREAM = 30_000
"""Request-seed streams of dynamic filtering's extra rounds (REFILL_STREAM + round)."""


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
    """One RL step (a `rlhf.core.loop.Job`). Construct on every rank with the same config. `evaluators`:
    callables of the trainer, each with a `period` in steps, returning metrics. `records`: the sample count
    and the sample files (default: count only). `rm_max_len`: reward models see at most this many tokens of
    each sample."""

    def __init__(self, cfg: TrainPPOConfig, topology: Topology, roles: Roles, engine: RolloutEngine,
                 sampler: PromptSampler, tokenizer, device: torch.device, evaluators=(),
                 agent: Agent | None = None, records: RunRecords | None = None,
                 rm_max_len: int | None = None) -> None:
        self.cfg, self.topology, self.roles, self.engine = cfg, topology, roles, engine
        self.sampler, self.tokenizer, self.device = sampler, tokenizer, device
        self.timer = StageTimer()
        self._per_call_noted = False  # the note on per-call extra logs under --dynamic_filtering, said once
        self.evaluators = list(evaluators)
        self.records = records or RunRecords(topology.rank == 0)
        self.rm_max_len = rm_max_len
        self.steps_done = 0  # steps finished when `evaluate` runs
        self.agent = agent  # --agent_func_path: samples are multi-turn episodes
        self.total_steps = total_steps(cfg.schedule, cfg.batch, sampler)  # the last step evaluates every evaluator
        self.policy_shape = shape_of_pretrained(cfg.model.pretrain, cfg.model.trust_remote_code)  # for perf/*

    @property
    def samples_drawn(self) -> int:
        """Responses sampled so far by the trained models (the sample budget)."""
        return self.records.samples_drawn

    def checkpointed(self) -> CheckpointedState:
        """The actor's and critic's engines, the KL controller, the reward statistics and the ptx walk (equal
        on every actor rank; rank 0 always hosts the actor)."""
        exp = self.roles.experience
        actor, critic = self.roles.actor, self.roles.critic
        hf = None
        if actor is not None:  # collective over the actor's ranks only
            def hf(directory: str) -> None:
                actor.model.save_hf(directory, self.tokenizer, self.topology.leads(Role.ACTOR))
        return CheckpointedState(
            engines={"actor": actor.model if actor is not None else None,
                     "critic": critic.model if critic is not None else None},
            components={"kl_ctl": exp.kl_ctl, "reward_stats": exp.reward_stats, "ptx": self.roles.ptx,
                        "records": self.records},
            hf_export=hf, next_samples=self.sampler.batch_ids)

    def evaluate(self) -> dict[str, float]:
        """The metrics of the evaluators due now (each has a `period` in steps; all run before the first step
        and after the last) with the sample count, also appended to --save_info_path's file."""
        done = self.steps_done
        due = [e for e in self.evaluators if done == 0 or done % e.period == 0 or done == self.total_steps]
        if not due:
            return {}
        metrics = {"samples_drawn": float(self.samples_drawn)}
        for evaluator in due:
            metrics.update(evaluator(self))
        self.records.info.append([metrics])
        return metrics

    def step(self, step: int) -> dict[str, float]:
        """One RL step. Hybrid-engine transitions (sleep/offload) all happen here, around the stages. On SIGTERM
        the step is abandoned after generation or after the experience (`rlhf.utils.preemption`)."""
        self.steps_done = step + 1
        pad = self.tokenizer.pad_token_id
        rollback = self._rollback()
        with self.timer.stage("generation"):
            with abandonable():
                local = self.generate(step)
                batch, scored, filtering, generated = None, None, {}, 0
                if self.cfg.algo.dynamic_filtering:  # more rounds until the step has enough informative groups
                    batch, scored, filtering, generated = self._informative_groups(step,
                                                                                   all_gather_rollout(local, pad))
            self.engine.sleep()  # vLLM frees its memory until the next weight push
            abandon_point(rollback)  # collective: the stage ends when the slowest rank's generation does
        with self.timer.stage("experience"):
            with abandonable():  # a reward function's or server's call may be cut short
                if batch is None:
                    batch = all_gather_rollout(local, pad)
                    generated = batch.num_samples
                experience, metrics = self._experience(batch, scored)
            abandon_point(rollback)
        metrics.update(filtering)
        self.records.samples_drawn += generated
        self.records.keep_negatives(batch, experience.raw_rewards_B, "policy", step)
        train_actor = step >= self.cfg.algo.freezing_actor_steps
        with self.timer.stage("train"):
            metrics.update(self._train_stage(experience, step, train_actor))
        with self.timer.stage("weight_sync"):
            self.engine.wake_up()
            if train_actor or self.cfg.rollout.vllm_enable_sleep:  # sleep level 2 dropped the weights
                self.sync_weights()
        if self.evaluators:
            metrics["samples_drawn"] = float(self.samples_drawn)
        return metrics

    def _rollback(self) -> Callable[[], None]:
        """Undoes what a step changes before it trains: this rank's RNG states, the KL controller and the reward
        statistics (the experience updates them)."""
        rng, exp = rng_state(), self.roles.experience
        saved = [(c, copy.deepcopy(c.state_dict())) for c in (exp.kl_ctl, exp.reward_stats)]

        def restore() -> None:
            set_rng_state(rng)
            for component, state in saved:
                component.load_state_dict(state)
        return restore

    def _experience(self, batch: Rollout, scored: Scored | None = None) -> tuple[Experience, dict[str, float]]:
        """The global batch's experience and metrics (`scored`: its rewards, when the filter asked for them);
        with --ref_reward_offload the frozen models are on the device only meanwhile."""
        offload = self.cfg.engine.ref_reward_offload
        self._move(self.roles.frozen, to_host=False, enabled=offload)
        experience, metrics = self.roles.experience.make(batch, rm_max_len=self.rm_max_len, scored=scored)
        self._move(self.roles.frozen, to_host=True, enabled=offload)
        return experience, metrics

    def _train_stage(self, experience: Experience, step: int, train_actor: bool) -> dict[str, float]:
        """`train`, with --deepspeed_enable_sleep's trainable models on the device only meanwhile (from step 1 on:
        they start there)."""
        sleep = self.cfg.engine.deepspeed_enable_sleep
        self._move(self.roles.trainable, to_host=False, enabled=sleep and step > 0)
        metrics = self.train(experience, step, train_actor)
        self._move(self.roles.trainable, to_host=True, enabled=sleep)
        return metrics

    def _informative_groups(self, step: int, first: Rollout) -> tuple[Rollout, Scored, dict[str, float], int]:
        """--dynamic_filtering: the step's --rollout_batch_size prompt groups, informative ones first (mean score
        strictly inside --dynamic_filtering_reward_range). While groups are missing, another round samples that
        many more prompts (rounded up to the engine count) drawn at random from the dataset, up to
        --dynamic_filtering_max_rounds rounds; then rejected groups fill the batch (the experience masks them:
        `kept_ratio` < 1). Returns the batch, its rewards (each sample is scored once), the filter's metrics and
        the samples generated. Collective."""
        a, n = self.cfg.algo, self.cfg.schedule.samples_per_prompt
        want, pad = self.cfg.batch.rollout_batch_size, self.tokenizer.pad_token_id
        engines = self.topology.num_engines
        kept: list[tuple[Rollout, Scored]] = []
        rejected: list[tuple[Rollout, Scored]] = []
        batch, drawn, rounds = first, 0, 0
        offload = self.cfg.engine.ref_reward_offload
        per_call: dict[str, list[torch.Tensor]] = {}  # extra logs given once per reward call, every round's
        while True:
            rounds += 1
            groups = batch.num_samples // n
            drawn += groups
            self._move(self.roles.frozen, to_host=False, enabled=offload)
            scored = self.roles.experience.scored(batch, self.rm_max_len)
            self._move(self.roles.frozen, to_host=True, enabled=offload)
            for key in scored.per_call:
                per_call.setdefault(key, []).append(scored.extra[key])
            keep = group_filter(scored.scores_B.reshape(groups, n), *a.dynamic_filtering_reward_range)
            for g in range(groups):
                members = list(range(g * n, (g + 1) * n))
                (kept if keep[g] else rejected).append((select_rollout(batch, members), scored.select(members)))
            if len(kept) >= want or rounds >= a.dynamic_filtering_max_rounds or hurry_agreed():
                break
            count = -(-(want - len(kept)) // engines) * engines
            prompts = self.sampler.refill(step, rounds, count)
            batch = all_gather_rollout(self.generate(step, stream=REFILL_STREAM + rounds, batch=prompts), pad)
        metrics = {"dynamic_filtering_pass_rate": 100.0 * len(kept) / drawn, "dynamic_filtering_rounds": rounds,
                   "dynamic_filtering_prompts": float(drawn)}
        if per_call and not self._per_call_noted:
            self._per_call_noted = True
            names = ", ".join(f"extra_logs[{k!r}]" for k in sorted(per_call))
            warnings.warn(f"the reward source gives {names} as one value per call, which describes every sample of "
                          "the call, filtered groups' too: with --dynamic_filtering reward_extra/ logs the mean of "
                          "those values over all the samples a step scored (every round); return one value per query "
                          "to log the mean over the kept samples", stacklevel=2)
        # a per-call value describes all of its call's samples: averaged over all of them, not the kept ones
        metrics.update({f"reward_extra/{k}": float(torch.cat(v).mean()) for k, v in per_call.items()})
        chosen = (kept + rejected)[:want]
        return (concat_rollouts([r for r, _ in chosen], pad), Scored.concat([s for _, s in chosen]), metrics,
                drawn * n)

    def _move(self, models: list[DeepSpeedModel], to_host: bool, enabled: bool) -> None:
        for model in models if enabled else []:
            model.offload() if to_host else model.reload(self.device)

    def _engine_prompts(self, step: int, stream: int = 0, batch: list[Prompt] | None = None
                        ) -> tuple[list[Prompt], list[int], int]:
        """Prompts for this rank's engine, their sampling seeds, and the index of this rank's share within
        them. Engine e of E takes prompts [e·P/E, (e+1)·P/E) of the P (fewer prompts than engines leave some
        engines idle). A prompt's seed depends only on (run seed, step, its index in the step's global batch):
        the ranks of one engine get the same seeds, and the samples do not depend on the number of engines.
        `batch`: a global batch other than the step's (e.g. held-out prompts)."""
        batch = self.sampler.batch(step) if batch is None else batch
        engines, index = self.topology.num_engines, self.topology.rollout_index
        first, end = index * len(batch) // engines, (index + 1) * len(batch) // engines
        seeds = [request_seed(self.cfg.seed, step, i, stream) for i in range(first, end)]
        return batch[first:end], seeds, self.topology.engine_rank

    def generate(self, step: int, stream: int = 0, batch: list[Prompt] | None = None,
                 spec: SamplingSpec | None = None) -> Rollout:
        """Sample the step's responses per prompt (`cfg.schedule.samples_per_prompt`) with the weights the engine holds;
        keep this rank's share of prompts. `stream` > 0: other seeds for the same prompts. `batch`: sample
        these prompts instead of the step's (every rank passes the same list). `spec`: other sampling
        settings (an evaluation's)."""
        prompts, seeds, share = self._engine_prompts(step, stream, batch)
        r = self.cfg.rollout
        spec = spec or SamplingSpec(n=self.cfg.schedule.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                                    max_tokens=r.generate_max_len)
        if not prompts:  # an idle engine this call: more engines than prompts
            generations = []
        elif self.agent is None:
            generations = self.engine.generate([list(p.token_ids) for p in prompts], spec, seeds)
        else:
            generations, outcomes = self._episodes(prompts, spec, seeds)
        per_rank = len(prompts) // self.topology.rollout_tp
        keep = slice(share * per_rank, (share + 1) * per_rank)
        rollout = to_rollout([list(p.token_ids) for p in prompts[keep]], generations[keep], self.tokenizer.pad_token_id,
                             self.tokenizer, [p.text for p in prompts[keep]], [p.label for p in prompts[keep]])
        if self.agent is not None:  # the episode outcomes replace the labels: `AgentRewards` reads them
            rollout.labels = outcomes[keep.start * spec.n:keep.stop * spec.n]
        count_generated(self.policy_shape, rollout.prompt_lens_B + rollout.response_lens_B,
                        float(rollout.response_lens_B.sum()))
        return rollout

    def _episodes(self, prompts: list[Prompt], spec: SamplingSpec, seeds: list[int]):
        """--agent_func_path: `spec.n` multi-turn episodes per prompt (`rlhf.agents.run_episodes`)."""
        a = self.cfg.agent
        limits = TurnLimits(max_total=self.cfg.data.prompt_max_len + self.cfg.rollout.generate_max_len,
                            max_turns=a.agent_max_turns, turn_max_tokens=a.agent_turn_max_tokens)
        return run_episodes(self.engine, self.agent, self.tokenizer, [list(p.token_ids) for p in prompts],
                            [p.text for p in prompts], [p.label for p in prompts], spec, seeds, limits)

    def _optimizer_batches(self, exp: Experience, role: Role, batcher: MicroBatcher, step: int,
                           epoch: int) -> list[list[Experience]]:
        """This replica's share of each optimizer step, cut into micro-batches. The step's samples do not depend
        on the data-parallel size: the whole experience is shuffled by (seed, step, epoch) alone and cut into
        global optimizer steps of --train_batch_size, of which each replica takes its share (the ranks of a ring
        take the same one): a contiguous one, or with --use_dynamic_batch one balanced by tokens
        (`MicroBatcher.replica_rows`). So a run resumed on another number of ranks or placement trains on the
        samples the uninterrupted run would have, step for step."""
        dp, rank = self.topology.dp_size(role), self.topology.dp_rank(role)
        order = list(range(exp.num_samples))
        random.Random(((self.cfg.seed * 100_003 + step) * 101 + epoch) * 4099).shuffle(order)
        per_step = self.cfg.batch.train_batch_size
        steps = [order[start:start + per_step] for start in range(0, len(order), per_step)]
        shares = [batcher.replica_rows(exp.attention_mask_BT[torch.tensor(rows)], dp, rank) for rows in steps]
        mine = [exp.select(torch.tensor([rows[i] for i in share])) for rows, share in zip(steps, shares)]
        return [[part.select(torch.tensor(rows)).trimmed() for rows in batcher.split(part.attention_mask_BT)]
                for part in mine]

    def train(self, exp: Experience, step: int, train_actor: bool) -> dict[str, float]:
        """max_epochs passes; actor and critic each on their own ranks. Metrics are global per-update means."""
        actor_stats: dict[str, float] = {}
        critic_stats: dict[str, float] = {}
        for epoch in range(self.cfg.batch.max_epochs):
            actor, critic = self.roles.actor, self.roles.critic
            if actor is not None and train_actor:
                for micro in self._optimizer_batches(exp, Role.ACTOR, actor.train_batcher, step, epoch):
                    add_update(actor_stats, actor.train_batch(micro, self.roles.experience.kl_ctl.value,
                                                              self.roles.ptx))
            if critic is not None:
                for micro in self._optimizer_batches(exp, Role.CRITIC, critic.train_batcher, step, epoch):
                    add_update(critic_stats, critic.train_batch(micro))
        return reduce_metrics({Role.ACTOR: per_update_means(actor_stats), Role.CRITIC: per_update_means(critic_stats)},
                              TRAIN_METRICS, self.topology)

    def sync_weights(self) -> None:
        """Push the actor's weights into every rank's engine (collective over the world)."""
        self.push_weights(Role.ACTOR, self.roles.actor)

    def push_weights(self, role: Role, model: Actor | None) -> None:
        """Load `role`'s weights (`model` where this rank hosts it, else None) into every rank's engine: directly
        when the role spans the world, else broadcast from its first rank. Collective over the world."""
        if len(self.topology.ranks(role)) == self.topology.world_size:  # the engine copies each tensor on arrival
            self.engine.load_weights(model.model.full_parameters(copy=False))
            return
        local = model.model.full_parameters(copy=False) if model is not None else None  # packed into buckets
        stream = broadcast_parameters(local, self.roles.actor_specs, src=self.topology.ranks(role)[0],
                                      bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20, device=self.device)
        if self.topology.generates:
            self.engine.load_weights(stream)
        else:  # --async_train: this rank's engine never generates; the buckets only pass through
            collections.deque(stream, maxlen=0)

