"""A job's config root and rank plan, read as a `JobMemory`: which models it holds (shapes from their
config.json only), on which ranks, and what each stage runs. One reader per kind of job, picked by the root's
registration (`rlhf.config.jobs.JOBS`, its `memory` kind); this module does not estimate anything itself.

Micro-batch tokens are worst cases: every sequence at its length limit (PPO: --prompt_max_len +
--generate_max_len; supervised jobs: --max_len, twice per sample for chosen/rejected pairs), or the token budget
with --use_dynamic_batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf.config.errors import UsageError
from rlhf.config.inference_config import BatchInferenceConfig
from rlhf.config.jobs import job_of
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.config.preference_config import PreferenceJobConfig
from rlhf.config.supervised_config import PairDataConfig, TrainKDConfig, TrainRMConfig
from rlhf.distributed.topology import Role
from rlhf.engines.rollout import rollout_engine_choice
from rlhf.planning.model_shapes import read_shape
from rlhf.planning.peak_memory import CUDA_RESERVE_BYTES, GiB, JobMemory, Model, Pass, Rollout, Training

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def device_bytes(gpu_memory_gb: float | None) -> int | None:
    """One device's bytes: --gpu_memory_gb, else the visible GPU's, else None (a CPU: nothing to fit into)."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * GiB)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def training(cfg: Any, device: int | None) -> Training:
    """The engine settings of a training job's config; `device`: the GPU's bytes, None on CPU."""
    e = cfg.engine
    return Training(dtype_bytes=DTYPE_BYTES[cfg.model.param_dtype], zero_stage=e.zero_stage,
                    adam_offload=e.adam_offload, gradient_checkpointing=cfg.model.gradient_checkpointing,
                    eager_attention=cfg.model.attn == "eager", ring_size=e.ring_attn_size,
                    tp_size=e.ds_tensor_parallel_size, cuda=device is not None, overlap_comm=e.overlap_comm,
                    accum_bytes=DTYPE_BYTES[e.grad_accum_dtype] if e.grad_accum_dtype else 0)


def micro_tokens(cfg: Any, samples: int, longest: int) -> int:
    """Tokens of one micro-batch per rank: the dynamic budget, or `samples` sequences of `longest` tokens."""
    e = cfg.engine
    return e.train_max_tokens_per_gpu if e.use_dynamic_batch else samples * longest


def ppo_memory(cfg: TrainPPOConfig, plan: dict[Role, tuple[int, ...]], device: int | None) -> JobMemory:
    """PPO and its critic-free relatives: the actor (and critic) trained, reference and reward models frozen,
    the rollout engine on every rank."""
    m, e, b, r = cfg.model, cfg.engine, cfg.batch, cfg.rollout
    longest = cfg.data.prompt_max_len + r.generate_max_len
    actor = read_shape(m.pretrain)
    models = {"actor": Model(actor, trained=True, lora_rank=m.lora.lora_rank, offload=e.deepspeed_enable_sleep)}
    for name in cfg.schedule.policy_copies:  # RePULSe's proposal: a second trained policy
        models[name] = Model(actor, trained=True, lora_rank=m.lora.lora_rank, offload=e.deepspeed_enable_sleep)
    if cfg.schedule.uses_critic:
        models["critic"] = Model(read_shape(cfg.critic_init), trained=True, scalar_head=True,
                                 lora_rank=m.lora.lora_rank, offload=e.deepspeed_enable_sleep)
    if cfg.algo.needs_ref:
        models["ref"] = Model(actor, trained=False, offload=e.ref_reward_offload)
    for i, path in enumerate(cfg.reward.reward_model_paths):
        models[f"reward{i or ''}"] = Model(read_shape(path), trained=False, scalar_head=True,
                                           offload=e.ref_reward_offload)
    ranks = {name: plan[Role.define(name.rstrip("0123456789") or name)] for name in models}
    exp_tokens = e.rollout_tokens_per_gpu if e.use_dynamic_batch else b.micro_rollout_batch_size * longest
    train_tokens = micro_tokens(cfg, b.micro_train_batch_size, longest)
    engines = len(plan[Role.ROLLOUT]) // r.vllm_tensor_parallel_size
    vllm = rollout_engine_choice(cfg.rollout)[0] == "vllm"
    sequences = -(-b.rollout_batch_size // engines) * cfg.schedule.samples_per_prompt
    rollout = Rollout(actor, vllm=vllm, tp=r.vllm_tensor_parallel_size, kv_cache_bytes=r.vllm_kv_cache_bytes,
                      gpu_fraction=r.vllm_gpu_memory_utilization, tokens_per_rank=sequences * longest,
                      sleep=r.vllm_enable_sleep and device is not None)
    stages = {"generation": (),
              "experience": tuple(Pass(n, exp_tokens, longest, train=False) for n in models),
              "train": tuple(Pass(n, train_tokens, longest, train=True) for n in models if models[n].trained),
              "weight_sync": ()}
    sync = min(r.weight_sync_bucket_mb << 20, actor.params() * DTYPE_BYTES[m.param_dtype])
    return JobMemory(models, ranks, stages, training(cfg, device), rollout, sync_bucket_bytes=sync, device_bytes=device,
                     reserve_bytes=CUDA_RESERVE_BYTES if device is not None else 0,
                     active={"experience": tuple(n for n in models if not models[n].trained),
                             "train": ("actor", "critic", *cfg.schedule.policy_copies)})


def supervised_memory(cfg: Any, plan: dict[Role, tuple[int, ...]], device: int | None) -> JobMemory:
    """SFT, reward and process-reward models, distillation and preference jobs: one trained model ("model"),
    and a frozen reference or teacher beside it (whole on ranks of its own, else as the engine holds it)."""
    m, d = cfg.model, cfg.data
    per_sample = 2 if isinstance(d, PairDataConfig) else 1
    tokens = micro_tokens(cfg, cfg.batch.micro_train_batch_size * per_sample, d.max_len)
    models = {"model": Model(read_shape(m.pretrain), trained=True, lora_rank=m.lora.lora_rank,
                             scalar_head=isinstance(cfg, TrainRMConfig))}
    frozen = {}
    if isinstance(cfg, PreferenceJobConfig):
        frozen["ref"] = (cfg.ref_path, cfg.ref.ref_offload)
    if isinstance(cfg, TrainKDConfig):
        frozen["teacher"] = (cfg.teacher.teacher_model, cfg.teacher.teacher_offload)
    ranks = {"model": plan[Role.define("model")]}
    for name, (path, offload) in frozen.items():
        ranks[name] = plan[Role.define(name)]
        models[name] = Model(read_shape(path), trained=False, offload=offload,
                             replicated=ranks[name] != ranks["model"])
    passes = tuple(Pass(n, tokens, d.max_len, train=models[n].trained) for n in models)
    return JobMemory(models, ranks, {"train": passes}, training(cfg, device), device_bytes=device,
                     reserve_bytes=CUDA_RESERVE_BYTES if device is not None else 0,
                     active={"train": tuple(models)})


def inference_memory(cfg: BatchInferenceConfig, plan: dict[Role, tuple[int, ...]], device: int | None
                     ) -> JobMemory:
    """Batch inference: one model, whole on every rank (ZeRO-0): vLLM or transformers' generate, or a reward
    model scoring rows."""
    shape = read_shape(cfg.model.pretrain)
    b = DTYPE_BYTES[cfg.model.param_dtype]
    everyone = tuple(sorted({r for ranks in plan.values() for r in ranks}))
    settings = Training(dtype_bytes=b, zero_stage=0)
    reserve = CUDA_RESERVE_BYTES if device is not None else 0
    if cfg.eval_task == "rm":
        model = Model(shape, trained=False, scalar_head=True)
        longest = cfg.data.max_len
        tokens = cfg.scoring.micro_batch_size * longest
        passes = (Pass("model", tokens, longest, train=False),)
        return JobMemory({"model": model}, {"model": everyone}, {"generation": passes}, settings,
                         device_bytes=device, reserve_bytes=reserve)
    longest = cfg.generation.prompt_max_len + cfg.generation.max_new_tokens
    v = cfg.vllm
    tp = v.tp_size or len(everyone)  # default: the ranks of one node
    rollout = Rollout(shape, vllm=cfg.eval_task == "generate_vllm", tp=tp, kv_cache_bytes=v.vllm_kv_cache_bytes,
                      gpu_fraction=v.vllm_gpu_memory_utilization, tokens_per_rank=v.max_num_seqs * longest)
    return JobMemory({}, {}, {"generation": ()}, settings, rollout, device_bytes=device, reserve_bytes=reserve)


READERS: dict[str, Callable[[Any, dict, int | None], JobMemory]] = {
    "ppo": ppo_memory, "supervised": supervised_memory, "inference": inference_memory}
"""A job's `memory` kind in `rlhf.config.jobs.JOBS` -> its reader. A root not registered there, or of a kind with no
reader, is refused, never planned as some other job (tests/unit/test_job_registry.py)."""


def job_memory(cfg: Any, plan: dict[Role, tuple[int, ...]]) -> JobMemory:
    """The `JobMemory` of the job configured by `cfg` (its root config) with the rank plan `plan`."""
    device = device_bytes(cfg.gpu_memory_gb)
    job = job_of(cfg)
    if job is not None and job.memory in READERS:
        return READERS[job.memory](cfg, plan, device)
    raise UsageError(f"--dry_run: no memory plan for {type(cfg).__name__} (" + (
        "not registered in rlhf.config.jobs.JOBS)" if job is None else
        f"rlhf.planning.job_memory.READERS has no reader of kind {job.memory!r})"))
