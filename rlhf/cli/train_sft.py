"""Entry point of supervised fine-tuning: `torchrun ... -m rlhf.cli.train_sft --pretrain ... --dataset ...`
(or srun). OpenRLHF v0.9.5's train_sft flags. Without --pretrain: the embedded tiny model learns the
embedded copy-task demonstrations.

Parses flags into `TrainSFTConfig`, checks outputs, model files and data before any engine starts, then
runs `SFTTrainer` on the core loop and writes the model in HF format to --save_path.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch.distributed as dist

from rlhf.cli.common import begin, check_outputs, for_this_machine, main_for, metrics_logger
from rlhf.config.errors import UsageError
from rlhf.config.supervised import TrainSFTConfig
from rlhf.data.sampler import DistributedBatchSampler
from rlhf.data.sources import read_rows
from rlhf.data.supervised import SFTSample, load_sft_samples
from rlhf.distributed.launch import init_distributed
from rlhf.distributed.topology import Role, Topology
from rlhf.models.loading import check_liger_kernel, check_local_model, load_causal_lm, load_tokenizer
from rlhf.train.build import check_model_configs, micro_batcher, model_builder, role_model
from rlhf.train.checkpoint import Checkpointer
from rlhf.train.loop import Loop
from rlhf.trainers.sft import SFTTrainer
from rlhf.utils.seeding import seed_everything
from rlhf.utils.watchdog import Watchdog


def check_before_engines(cfg: TrainSFTConfig, world_size: int) -> None:
    """Flags, model files and outputs, before any engine or process group starts."""
    e, b, d = cfg.engine, cfg.batch, cfg.data
    if world_size % e.ring_attn_size:
        raise UsageError(f"the {world_size} ranks do not split into rings of --ring_attn_size {e.ring_attn_size}")
    dp = world_size // e.ring_attn_size
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
    check_outputs(cfg.logging, cfg.checkpoint, TrainSFTConfig().checkpoint.ckpt_path)


def load_samples(cfg: TrainSFTConfig, tokenizer, dataset: str, split: str, probs: str | None,
                 flag: str) -> list[SFTSample]:
    d = cfg.data
    rows = read_rows(dataset, probs=probs, split=split, max_samples=d.max_samples, seed=cfg.seed, flag=flag)
    samples, _ = load_sft_samples(rows, tokenizer, input_key=d.input_key, output_key=d.output_key,
                                  input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                  multiturn=d.multiturn, pretrain_mode=d.pretrain_mode, max_len=d.max_len,
                                  tokenizer_chat_template=d.tokenizer_chat_template)
    return samples


def run(cfg: TrainSFTConfig, parse_warnings: Sequence[warnings.WarningMessage] = ()) -> None:
    launch, preemption = begin(cfg.logging, parse_warnings)
    demo = cfg.model.pretrain is None
    cfg = for_this_machine(cfg.with_demo_defaults())
    check_before_engines(cfg, launch.world_size)
    m, e, b, d = cfg.model, cfg.engine, cfg.batch, cfg.data
    tokenizer = load_tokenizer(m.pretrain, m.trust_remote_code)
    samples = load_samples(cfg, tokenizer, d.dataset, d.dataset_split, d.dataset_probs, "--dataset")
    eval_samples = (load_samples(cfg, tokenizer, d.eval_dataset, d.eval_split, None, "--eval_dataset")
                    if d.eval_dataset else [])
    if len(samples) < b.train_batch_size:
        raise UsageError(f"--dataset {d.dataset}: {len(samples)} usable samples, fewer than one --train_batch_size "
                         f"{b.train_batch_size}; lower it or add data")
    device = init_distributed(launch, cfg.dist_timeout)
    Watchdog(launch.rank, cfg.watchdog_interval).start()
    topology = Topology({Role.ACTOR: tuple(range(launch.world_size))}, ring_size=e.ring_attn_size)
    dp = topology.dp_size(Role.ACTOR)
    sampler = DistributedBatchSampler(len(samples), b.train_batch_size, dp, topology.dp_rank(Role.ACTOR), cfg.seed)
    steps = sampler.steps_per_epoch * b.max_epochs
    steps = min(steps, b.max_steps) if b.max_steps else steps
    eval_every = None
    if eval_samples:
        eval_every = cfg.logging.eval_steps if cfg.logging.eval_steps > 0 else sampler.steps_per_epoch
    elif cfg.logging.eval_steps > 0:
        warnings.warn(f"--eval_steps {cfg.logging.eval_steps} has no effect without --eval_dataset", stacklevel=2)
    is_writer = launch.rank == 0
    if is_writer:
        if demo:
            print("no --pretrain given: fine-tuning the embedded tiny demo model on its demonstrations", flush=True)
        print(f"SFT: {len(samples)} samples, {b.max_epochs} epoch(s) of {sampler.steps_per_epoch} steps of "
              f"{b.train_batch_size} samples ({steps} steps); {dp} data-parallel replica(s)"
              + (f"; held-out NLL of {len(eval_samples)} samples every {eval_every} steps" if eval_every else ""),
              flush=True)
    seed_everything(cfg.seed + launch.rank, cfg.full_determinism)
    batcher = micro_batcher(e, b.micro_train_batch_size, topology, Role.ACTOR)
    build = model_builder(m, e, batcher.layout, lambda attn: load_causal_lm(m.pretrain, m.dtype, attn,
                                                                            m.trust_remote_code))
    model = role_model(build, m, e, cfg.optim, topology, Role.ACTOR, device, trainable=True,
                       micro_batch_size=b.micro_train_batch_size,
                       grad_accum_steps=b.train_batch_size // (b.micro_train_batch_size * dp),
                       num_optimizer_steps=steps, learning_rate=cfg.optim.learning_rate, name="model")
    trainer = SFTTrainer(model, topology, samples, eval_samples, sampler, batcher, tokenizer, device,
                         cfg.aux_loss_coef)
    logger = metrics_logger(cfg, steps, is_writer, "sft steps", {"loss": "gpt_loss"})
    checkpointer = Checkpointer(cfg.checkpoint, default_ckpt_path=TrainSFTConfig().checkpoint.ckpt_path,
                                rank=launch.rank, world_size=launch.world_size, logger=logger)
    loop = Loop(steps, cfg.logging.logging_steps, cfg.checkpoint.save_steps, eval_every, logger, checkpointer,
                launch.rank)
    start = loop.resume(trainer)
    try:
        if loop.fit(trainer, start, preemption):
            model.save_hf(cfg.logging.save_path, tokenizer, topology.leads(Role.ACTOR))
    finally:
        logger.close()
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    main_for(TrainSFTConfig, run, "python -m rlhf.cli.train_sft", argv)


if __name__ == "__main__":
    main()
