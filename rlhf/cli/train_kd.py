"""Entry point of knowledge distillation: `torchrun ... -m rlhf.cli.train_kd --pretrain STUDENT --teacher_model
TEACHER --dataset ...` (or srun), with OpenRLHF v0.9.5's train_kd flags. The teacher is a frozen role on the
student's ranks (sharded at ZeRO-3, in host memory between forwards with --teacher_offload). Without
--pretrain: the embedded tiny model is the student on the embedded demonstrations (the teacher is always
named). The student is written in HF format to --save_path.
"""

from __future__ import annotations

import dataclasses

from rlhf.cli.common import main_for
from rlhf.cli.supervised import Built, SupervisedJob, run_supervised, save_trained_model
from rlhf.cli.train_sft import SFT_JOB
from rlhf.config.errors import UsageError
from rlhf.config.supervised import TrainKDConfig
from rlhf.distributed.topology import Role
from rlhf.models.layout import SequenceLayout
from rlhf.models.loading import check_local_model, load_causal_lm
from rlhf.train.build import check_model_configs, model_builder, role_model
from rlhf.trainers.kd import TEACHER, DistillationTrainer, TeacherLink, TeacherService, teacher_rank_of


def _check(cfg: TrainKDConfig) -> None:
    """The teacher exists, fits --max_len and shares the student's vocabulary."""
    from transformers import AutoConfig

    path = cfg.teacher.teacher_model
    check_local_model(path, "--teacher_model")
    check_model_configs([("--teacher_model", path)], cfg.model, cfg.engine, longest=cfg.data.max_len,
                        length_flags=f"--max_len {cfg.data.max_len}")
    sizes = {flag: AutoConfig.from_pretrained(p, trust_remote_code=cfg.model.trust_remote_code,
                                              local_files_only=True).vocab_size
             for flag, p in (("--pretrain", cfg.model.pretrain), ("--teacher_model", path))}
    if len(set(sizes.values())) != 1:
        raise UsageError(f"the teacher and the student must share one vocabulary for the KL over it: vocab_size "
                         f"{sizes['--teacher_model']} (--teacher_model {path}) vs {sizes['--pretrain']} (--pretrain "
                         f"{cfg.model.pretrain})")


def _plan(cfg: TrainKDConfig, world_size: int) -> dict[Role, tuple[int, ...]]:
    """The student on every rank with a colocated teacher, or on the first ranks with the teacher on the last
    --teacher_num_nodes x --teacher_num_gpus_per_node."""
    everyone = tuple(range(world_size))
    teacher_ranks = cfg.teacher.num_ranks
    if not teacher_ranks:
        return {Role.ACTOR: everyone, TEACHER: everyone}
    if teacher_ranks >= world_size:
        raise UsageError(f"the teacher's {teacher_ranks} ranks (--teacher_num_nodes x --teacher_num_gpus_per_node) "
                         f"leave none of the {world_size} for the student: lower them or add ranks")
    return {Role.ACTOR: everyone[:-teacher_ranks], TEACHER: everyone[-teacher_ranks:]}


def _trainer(cfg: TrainKDConfig, b: Built) -> DistillationTrainer | TeacherService:
    m, t, topology = cfg.model, cfg.teacher, b.topology
    own_ranks = topology.ranks(TEACHER) != topology.ranks(Role.ACTOR)
    if own_ranks and not topology.hosts(TEACHER):  # a student rank: its teacher is elsewhere
        link = TeacherLink(teacher_rank_of(topology, topology.rank), b.model.module.config.vocab_size)
        return DistillationTrainer(*b.trainer_args, teacher=link, kd_coef=t.kd_coef, teacher_offload=False)
    # on its own ranks the teacher is replicated (each serves its students alone) and keeps whole sequences
    engine = dataclasses.replace(cfg.engine, zero_stage=0) if own_ranks else cfg.engine
    layout = SequenceLayout(packing=cfg.engine.packing_samples) if own_ranks else b.batcher.layout
    teacher = role_model(model_builder(m, engine, layout, lambda attn: load_causal_lm(t.teacher_model, m.dtype, attn,
                                                                                     m.trust_remote_code)),
                         m, engine, cfg.optim, topology, TEACHER, b.device, trainable=False,
                         micro_batch_size=cfg.batch.micro_train_batch_size, name="teacher")
    if own_ranks:
        return TeacherService(teacher, topology, layout, b.device, has_eval=bool(b.eval_samples))
    if t.teacher_offload:
        teacher.offload()
    return DistillationTrainer(*b.trainer_args, teacher=teacher, kd_coef=t.kd_coef, teacher_offload=t.teacher_offload)


KD_JOB = SupervisedJob(
    name="kd", samples=SFT_JOB.samples, load_model=SFT_JOB.load_model, make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "gpt_loss", "kd": "distil_loss"}, check=_check, plan=_plan,
    demo_line="no --pretrain given: distilling into the embedded tiny demo model on its demonstrations")


def main(argv: list[str] | None = None) -> None:
    main_for(TrainKDConfig, lambda cfg, w: run_supervised(KD_JOB, cfg, w), "python -m rlhf.cli.train_kd", argv)


if __name__ == "__main__":
    main()
