"""The KD job's parts (`KD_JOB`) and its run; the entry point is `rlhf.cli.train_kd`."""

from __future__ import annotations

from rlhf.config.supervised_config import TrainKDConfig
from rlhf.core.loop import Job
from rlhf.distributed.topology import Role
from rlhf.jobs.sft import SFT_JOB
from rlhf.jobs.supervised_run import (
    Built,
    SupervisedJob,
    check_frozen_model,
    frozen_plan,
    frozen_role,
    run_supervised,
    save_trained_model,
)
from rlhf.models.loading import load_causal_lm
from rlhf.trainers.frozen import padded_logits
from rlhf.trainers.kd_trainer import TEACHER, DistillationTrainer


def _check(cfg: TrainKDConfig) -> None:
    check_frozen_model(cfg, cfg.teacher.teacher_model, "--teacher_model", "the teacher")


def _plan(cfg: TrainKDConfig, world_size: int) -> dict[Role, tuple[int, ...]]:
    return frozen_plan(TEACHER, cfg.teacher.num_ranks, "--teacher_num_nodes x --teacher_num_gpus_per_node",
                       world_size)


def _trainer(cfg: TrainKDConfig, b: Built) -> Job:
    """The student with its teacher colocated or on its own ranks (or, there, the teacher's service)."""
    t, m = cfg.teacher, cfg.model
    vocab = (b.model.module.config.vocab_size,) if b.model else ()
    load = lambda attn: load_causal_lm(t.teacher_model, m.dtype, attn, m.trust_remote_code)  # noqa: E731
    return frozen_role(cfg, b, TEACHER, load, padded_logits, offload=t.teacher_offload, tail=vocab,
                       make_trainer=lambda teacher: DistillationTrainer(*b.trainer_args, teacher=teacher,
                                                                        kd_coef=t.kd_coef),
                       served=DistillationTrainer)


KD_JOB = SupervisedJob(
    name="kd", samples=SFT_JOB.samples, load_model=SFT_JOB.load_model, make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "gpt_loss", "kd": "distil_loss"}, check=_check, plan=_plan,
    demo_line="no --pretrain given: distilling into the embedded tiny demo model on its demonstrations")


def run(cfg: TrainKDConfig, parse_warnings=()) -> None:
    run_supervised(KD_JOB, cfg, parse_warnings)
