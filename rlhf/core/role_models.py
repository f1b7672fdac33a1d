"""Building a role's trainable or frozen model, its sequence layout and its micro-batcher from the shared
sub-configs, and the model-file checks every job runs before any engine starts. Job-agnostic: a job passes
the role, its sizes and the loader of its model class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf.config.shared_config import EngineConfig, ModelConfig, OptimConfig
from rlhf.core.throughput import count_work
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel, GroupMPU
from rlhf.models.layout import SequenceLayout
from rlhf.models.loading import apply_liger_kernel
from rlhf.models.lora import apply_lora, check_lora
from rlhf.models.micro_batches import MicroBatcher


def check_model_configs(models: list[tuple[str, str]], model: ModelConfig, engine: EngineConfig, *,
                        longest: int, length_flags: str) -> None:
    """For each (flag, local model directory): `longest` tokens (named by `length_flags`) fit its
    max_position_embeddings, and with ring attention --ring_head_stride divides its key/value heads; and the
    LoRA settings can run here (--load_in_4bit: CUDA). Run before any engine starts, so errors name our flags
    rather than a library's."""
    from transformers import AutoConfig

    from rlhf.models.loading import check_local_model

    check_lora(model.lora)
    for flag, path in models:
        check_local_model(path, flag)
        config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code, local_files_only=True)
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            raise ValueError(f"{length_flags} = {longest} tokens exceeds the {limit} positions of {flag} {path} "
                             f"(max_position_embeddings): lower it to at most {limit}")
        if engine.ring_attn_size > 1:
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            if kv_heads % engine.ring_head_stride:
                raise ValueError(f"--ring_head_stride {engine.ring_head_stride} must divide the {kv_heads} key/value "
                                 f"heads of {flag} {path}")


def layout_for(engine: EngineConfig, topology: Topology, role: Role) -> SequenceLayout:
    """How `role`'s model sees its micro-batches: padded, packed, or packed over its ring."""
    return SequenceLayout(packing=engine.packing_samples, ring_group=topology.ring_group(role),
                          ring_head_stride=engine.ring_head_stride)


def micro_batcher(engine: EngineConfig, size: int, topology: Topology, role: Role, max_tokens: int | None = None,
                  flag: str = "--train_max_tokens_per_gpu") -> MicroBatcher:
    """`size` samples per micro-batch, or with --use_dynamic_batch as many as fit `max_tokens` (default
    --train_max_tokens_per_gpu) per rank."""
    budget = (max_tokens or engine.train_max_tokens_per_gpu) if engine.use_dynamic_batch else None
    return MicroBatcher(size, budget, topology.group(role), layout_for(engine, topology, role), flag)


def model_builder(model: ModelConfig, engine: EngineConfig, layout: SequenceLayout,
                  load: Callable[[str], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """A `build()` for DeepSpeedModel: `load(attn_implementation)` (the layout's), then Liger when asked."""
    def build() -> torch.nn.Module:
        module = load(layout.attn_implementation(model.attn))
        return apply_liger_kernel(module) if engine.use_liger_kernel else module
    return build


def role_model(build: Callable[[], torch.nn.Module], model: ModelConfig, engine: EngineConfig, optim: OptimConfig,
               topology: Topology, role: Role, device: torch.device, *, trainable: bool, micro_batch_size: int,
               grad_accum_steps: int = 1, num_optimizer_steps: int = 1, learning_rate: float = 0.0,
               name: str | None = None, ema_beta: float | None = None) -> DeepSpeedModel:
    """`role`'s model on DeepSpeed over the role's group (build on every rank hosting the role), its linear layers
    split over the role's tensor-parallel group with --ds_tensor_parallel_size. A trainable
    model gets LoRA adapters when --lora_rank > 0 (frozen ones never do); `ema_beta`: a moving average of its
    weights (`DeepSpeedModel`)."""
    tp_group = topology.tp_group(role)
    mpu = (GroupMPU(topology.data_group(role), tp_group or topology.self_group)
           if topology.has_subgroups or tp_group is not None else None)
    adapt = (lambda module: apply_lora(module, model.lora)) if trainable and model.lora.enabled else None
    counted = lambda: count_work(build(), name or role.value)  # noqa: E731  (its forwards feed perf/*)
    return DeepSpeedModel(
        counted, engine, optim, learning_rate=learning_rate, bf16=model.param_dtype == "bf16",
        fp16=model.param_dtype == "fp16", micro_batch_size=micro_batch_size,
        grad_accum_steps=max(grad_accum_steps, 1), num_optimizer_steps=max(num_optimizer_steps, 1), device=device,
        dp_group=topology.data_group(role), mpu=mpu, tp_group=tp_group, trainable=trainable,
        gradient_checkpointing=model.gradient_checkpointing and trainable,
        checkpoint_reentrant=model.gradient_checkpointing_use_reentrant, hpz_group=topology.hpz_group(role),
        ema_beta=ema_beta, name=name or role.value, adapt=adapt)
