"""The parts every supervised job (SFT, reward model, process reward model, distillation, preference) gives the
core run (`rlhf.core.run.run_job`): checks before any engine, samples, the rank plan, the sampler, the model and
the final HF model. A job's CLI module gives a `SupervisedJob` (its samples, its model, its step and its saved
model) and nothing else.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config.errors import UsageError
from rlhf.config.supervised_config import DEMO_MAX_LEN
from rlhf.core.loop import Job
from rlhf.core.role_models import check_model_configs, micro_batcher, model_builder, role_model
from rlhf.core.run import Assembled, JobParts, Started, run_job
from rlhf.data.sampler import DistributedBatchSampler
from rlhf.data.sources import read_rows
from rlhf.distributed.launch_env import LaunchEnv
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.layout import SequenceLayout
from rlhf.models.loading import check_liger_kernel, check_local_model, load_tokenizer
from rlhf.models.micro_batches import MicroBatcher
from rlhf.trainers.frozen import Answer, Frozen, FrozenLink, FrozenModel, FrozenService, server_rank_of
from rlhf.trainers.supervised_trainer import MODEL


@dataclass(frozen=True)
class Built:
    """What `SupervisedJob.make_trainer` receives (`model` is None on ranks that do not host the student)."""

    model: DeepSpeedModel | None
    topology: Topology
    samples: list
    eval_samples: list
    sampler: DistributedBatchSampler
    batcher: MicroBatcher
    tokenizer: Any
    device: torch.device

    @property
    def trainer_args(self) -> tuple:
        """The positional arguments of a `SupervisedTrainer`."""
        return (self.model, self.topology, self.samples, self.eval_samples, self.sampler, self.batcher,
                self.tokenizer, self.device)


def save_trained_model(cfg, trainer, built: Built) -> None:
    """The trained model in HF format into --save_path (its `save_hf`; ranks without the model skip it)."""
    if built.model is not None:
        trainer.save_hf(cfg.logging.save_path)


@dataclass(frozen=True)
class SupervisedJob:
    """One supervised job. `name`: shown in the startup line and the progress bar. `samples(cfg, tokenizer,
    rows)`: the job's samples of some rows (errors name the row). `load_model(cfg, attn)`: the trainable
    module. `make_trainer(cfg, built)`: the step (a `Job`). `save(cfg, trainer, built)`: the final model
    under --save_path (collective). `bar`: progress-bar label -> metric."""

    name: str
    samples: Callable[[Any, Any, list], list]
    load_model: Callable[[Any, str], torch.nn.Module]
    make_trainer: Callable[[Any, Built], Job]
    save: Callable[[Any, Job, Built], None]
    bar: dict[str, str]
    demo_line: str
    colocated_roles: tuple[Role, ...] = ()  # frozen roles on every rank next to the trained model
    check: Callable[[Any], None] | None = None  # the job's own checks before any engine starts
    plan: Callable[[Any, int], dict[Role, tuple[int, ...]]] | None = None  # own rank ranges (default: colocated)


def check_frozen_model(cfg, path: str, flag: str, what: str) -> None:
    """The frozen model at `path` (given by `flag`) exists, fits --max_len and shares --pretrain's vocabulary
    (`what`: the role, for the error)."""
    from transformers import AutoConfig

    check_local_model(path, flag)
    check_model_configs([(flag, path)], cfg.model, cfg.engine, longest=cfg.data.max_len,
                        length_flags=f"--max_len {cfg.data.max_len}")
    sizes = {f: AutoConfig.from_pretrained(p, trust_remote_code=cfg.model.trust_remote_code,
                                           local_files_only=True).vocab_size
             for f, p in (("--pretrain", cfg.model.pretrain), (flag, path))}
    if len(set(sizes.values())) != 1:
        raise UsageError(f"{what} and the trained model must share one vocabulary: vocab_size {sizes[flag]} ({flag} "
                         f"{path}) vs {sizes['--pretrain']} (--pretrain {cfg.model.pretrain})")


def frozen_plan(role: Role, num_ranks: int, flags: str, world_size: int) -> dict[Role, tuple[int, ...]]:
    """The trained model on every rank with `role` colocated (`num_ranks` 0), or on the first ranks with
    `role` on the last `num_ranks` (`flags`: the flags that set them, for the error)."""
    everyone = tuple(range(world_size))
    if not num_ranks:
        return {MODEL: everyone, role: everyone}
    if num_ranks >= world_size:
        raise UsageError(f"the {role.value}'s {num_ranks} ranks ({flags}) leave none of the {world_size} for the "
                         "trained model: lower them or add ranks")
    return {MODEL: everyone[:-num_ranks], role: everyone[-num_ranks:]}


def frozen_role(cfg, built: Built, role: Role, load: Callable[[str], torch.nn.Module], answer: Answer, *,
                offload: bool, tail: Sequence[int], make_trainer: Callable[[Frozen], Job], served: type) -> Job:
    """The job of this rank for a trained model with a frozen `role` (a teacher, a reference): on a rank of
    the trained model, `make_trainer(frozen)` with the role colocated (a `FrozenModel`, in host memory between
    phases with `offload`) or reached through a `FrozenLink`; on a rank of the role's own, a `FrozenService`
    (replicated, whole sequences per rank: ZeRO-0; it mirrors the collectives that `served`, the trainer's class,
    declares).
    `load(attn)`: the frozen module; `tail`: the answer's trailing shape."""
    m, topology = cfg.model, built.topology
    own_ranks = topology.ranks(role) != topology.ranks(MODEL)
    if own_ranks and not topology.hosts(role):  # a trained-model rank: its frozen role is elsewhere
        return make_trainer(FrozenLink(server_rank_of(topology, role, topology.rank), tail, built.device))
    engine = dataclasses.replace(cfg.engine, zero_stage=0) if own_ranks else cfg.engine
    layout = SequenceLayout(packing=cfg.engine.packing_samples) if own_ranks else built.batcher.layout
    model = role_model(model_builder(m, engine, layout, load), m, engine, cfg.optim, topology, role, built.device,
                       trainable=False, micro_batch_size=cfg.batch.micro_train_batch_size, name=role.value)
    if own_ranks:
        return FrozenService(model, role, topology, layout, answer, built.device, served,
                             has_eval=bool(built.eval_samples))
    return make_trainer(FrozenModel(model, layout, answer, built.device, offload))


def check_before_engines(cfg, num_ranks: int) -> None:
    """Flags and model files, before any engine or process group starts (`num_ranks`: the trained model's)."""
    e, b, d = cfg.engine, cfg.batch, cfg.data
    if num_ranks % e.replica_size:
        raise UsageError(f"the {num_ranks} ranks do not split into {e.replica_groups}")
    dp = num_ranks // e.replica_size
    per = 1 if e.use_dynamic_batch else b.micro_train_batch_size
    if b.train_batch_size % (per * dp):
        raise UsageError(f"--train_batch_size {b.train_batch_size} must be a multiple of "
                         + ("" if e.use_dynamic_batch else f"--micro_train_batch_size {b.micro_train_batch_size} x ")
                         + f"the {dp} data-parallel replicas")
    if e.use_dynamic_batch:
        per_rank = -(-d.max_len // (2 * e.ring_attn_size)) * 2 if e.ring_attn_size > 1 else d.max_len
        if e.train_max_tokens_per_gpu < per_rank:
            raise UsageError(f"--train_max_tokens_per_gpu {e.train_max_tokens_per_gpu} cannot hold one sample of "
                             f"--max_len {d.max_len} tokens ({per_rank} per rank): raise it to at least {per_rank}")
    if e.use_liger_kernel:
        check_liger_kernel()
    check_local_model(cfg.model.pretrain, "--pretrain")
    check_model_configs([("--pretrain", cfg.model.pretrain)], cfg.model, e, longest=d.max_len,
                        length_flags=f"--max_len {d.max_len}")


def read_samples(job: SupervisedJob, cfg, tokenizer, dataset: str, split: str, probs: str | None, flag: str) -> list:
    rows = read_rows(dataset, probs=probs, split=split, max_samples=cfg.data.max_samples, seed=cfg.seed, flag=flag)
    return job.samples(cfg, tokenizer, rows)


class SupervisedRun(JobParts):
    """The core run's parts of a supervised job: its checks, samples and rank plan; its sampler, model and
    step."""

    def __init__(self, job: SupervisedJob):
        self.job = job
        self.name, self.bar = job.name, job.bar
        self.demo_line = f"{job.demo_line} (--max_len {DEMO_MAX_LEN} unless given)"

    def prepare(self, cfg, launch: LaunchEnv) -> dict[Role, tuple[int, ...]]:
        job, everyone = self.job, tuple(range(launch.world_size))
        plan = (job.plan(cfg, launch.world_size) if job.plan is not None
                else {role: everyone for role in (MODEL, *job.colocated_roles)})
        check_before_engines(cfg, len(plan[MODEL]))
        if job.check is not None:
            job.check(cfg)
        d, b = cfg.data, cfg.batch
        self.tokenizer = load_tokenizer(cfg.model.pretrain, cfg.model.trust_remote_code,
                                        use_fast=not cfg.model.disable_fast_tokenizer)
        self.samples = read_samples(job, cfg, self.tokenizer, d.dataset, d.dataset_split, d.dataset_probs,
                                    "--dataset")
        self.eval_samples = (read_samples(job, cfg, self.tokenizer, d.eval_dataset, d.eval_split, None,
                                          "--eval_dataset") if d.eval_dataset else [])
        if len(self.samples) < b.train_batch_size:
            raise UsageError(f"--dataset {d.dataset}: {len(self.samples)} usable samples, fewer than one "
                             f"--train_batch_size {b.train_batch_size}; lower it or add data")
        return plan

    def _schedule(self, run: Started) -> tuple[DistributedBatchSampler, int, int | None]:
        """The sampler of this rank, the number of steps and the evaluation interval."""
        cfg, topology, b = run.cfg, run.topology, run.cfg.batch
        student = topology.hosts(MODEL)
        sampler = DistributedBatchSampler(len(self.samples), b.train_batch_size, topology.dp_size(MODEL),
                                          topology.dp_rank(MODEL) if student else 0, cfg.seed)
        steps = sampler.steps_per_epoch * b.max_epochs
        steps = min(steps, b.max_steps) if b.max_steps else steps
        eval_every = None
        if self.eval_samples:
            eval_every = cfg.logging.eval_steps if cfg.logging.eval_steps > 0 else sampler.steps_per_epoch
        return sampler, steps, eval_every

    def describe(self, run: Started) -> list[str]:
        topology, b = run.topology, run.cfg.batch
        sampler, steps, eval_every = self._schedule(run)
        everyone = tuple(range(topology.world_size))
        return [f"{self.name}: {len(self.samples)} samples, {b.max_epochs} epoch(s) of {sampler.steps_per_epoch} "
                f"steps of {b.train_batch_size} samples ({steps} steps); {topology.dp_size(MODEL)} data-parallel "
                "replica(s)"
                + (f", each split over {topology.tp_size} ranks (--ds_tensor_parallel_size: the models' linear "
                   "layers, by DeepSpeed AutoTP)" if topology.tp_size > 1 else "")
                + "".join(f"; {role.value} on ranks {ranks[0]}-{ranks[-1]}" for role, ranks in topology.plan.items()
                          if role is not MODEL and ranks != everyone)
                + (f"; held-out metrics of {len(self.eval_samples)} samples every {eval_every} steps"
                   if eval_every else "")]

    def build(self, run: Started) -> Assembled:
        cfg, topology = run.cfg, run.topology
        m, e, b = cfg.model, cfg.engine, cfg.batch
        sampler, steps, eval_every = self._schedule(run)
        if not self.eval_samples and cfg.logging.eval_steps > 0:
            warnings.warn(f"--eval_steps {cfg.logging.eval_steps} has no effect without --eval_dataset",
                          stacklevel=2)
        dp = topology.dp_size(MODEL)
        batcher = micro_batcher(e, b.micro_train_batch_size, topology, MODEL)
        model = role_model(model_builder(m, e, batcher.layout, lambda attn: self.job.load_model(cfg, attn)), m, e,
                           cfg.optim, topology, MODEL, run.device, trainable=True,
                           micro_batch_size=b.micro_train_batch_size,
                           grad_accum_steps=b.train_batch_size // (b.micro_train_batch_size * dp),
                           num_optimizer_steps=steps, learning_rate=cfg.optim.learning_rate,
                           name="model") if topology.hosts(MODEL) else None
        built = Built(model, topology, self.samples, self.eval_samples, sampler, batcher, self.tokenizer,
                      run.device)
        trainer = self.job.make_trainer(cfg, built)
        return Assembled(trainer, steps, eval_every, cfg.checkpoint.save_steps,
                         save=lambda: self.job.save(cfg, trainer, built))


def run_supervised(job: SupervisedJob, cfg, parse_warnings: Sequence[warnings.WarningMessage] = ()) -> None:
    """Train `job` with `cfg` (a supervised root config) on every rank."""
    run_job(SupervisedRun(job), cfg, parse_warnings)
