"""A trainable HF model on DeepSpeed: ZeRO 0-3, AdamW, LR schedule, clipping, checkpointed activations.

Owns the DeepSpeed config and engine of one role over that role's data-parallel group. Knows
nothing about RL: callers compute losses. `backward` takes a loss already normalised by the global
token count of the optimizer step and undoes DeepSpeed's own averaging, so the gradient is the
same for any split of the step over DP ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import deepspeed
import torch
import torch.distributed as dist

from rlhf.config.schema import EngineConfig, ModelConfig, OptimConfig
from rlhf.models.loading import load_causal_lm


def ds_config(engine: EngineConfig, optim: OptimConfig, *, bf16: bool, micro_batch_size: int,
              grad_accum_steps: int) -> dict:
    """The DeepSpeed JSON config for one trainable model (pure)."""
    zero: dict = {"stage": engine.zero_stage, "overlap_comm": engine.overlap_comm,
                  "reduce_bucket_size": "auto" if engine.zero_stage == 3 else 5e8}
    if engine.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=5e7,
                    stage3_max_live_parameters=1e9, stage3_gather_16bit_weights_on_model_save=True)
        zero["reduce_bucket_size"] = 5e8
    if engine.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": optim.max_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _scheduler(optimizer, optim: OptimConfig, num_optimizer_steps: int):
    from transformers import get_scheduler

    kwargs = {"min_lr_rate": 0.1} if optim.lr_scheduler == "cosine_with_min_lr" else None
    return get_scheduler(optim.lr_scheduler, optimizer,
                         num_warmup_steps=int(round(optim.lr_warmup_ratio * num_optimizer_steps)),
                         num_training_steps=num_optimizer_steps, scheduler_specific_kwargs=kwargs)


class DeepSpeedModel:
    """One trainable causal LM on DeepSpeed. Construct on every rank of `dp_group`, same arguments."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, optim_cfg: OptimConfig, *,
                 micro_batch_size: int, grad_accum_steps: int, num_optimizer_steps: int,
                 dp_group: dist.ProcessGroup | None = None) -> None:
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(group=dp_group)
        self.grad_accum_steps = grad_accum_steps
        self.zero_stage = engine_cfg.zero_stage
        dtype = torch.bfloat16 if model_cfg.bf16 else torch.float32
        self.config = ds_config(engine_cfg, optim_cfg, bf16=model_cfg.bf16, micro_batch_size=micro_batch_size,
                                grad_accum_steps=grad_accum_steps)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        model = self._build_model(model_cfg, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim_cfg.actor_learning_rate,
                                      betas=tuple(optim_cfg.adam_betas), weight_decay=optim_cfg.l2)
        scheduler = _scheduler(optimizer, optim_cfg, num_optimizer_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.config,
            dist_init_required=False)

    def _build_model(self, model_cfg: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        keep_alive = None
        if self.zero_stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            keep_alive = HfDeepSpeedConfig(self.config)  # must outlive from_pretrained
        model = load_causal_lm(model_cfg.pretrain, dtype, model_cfg.attn, model_cfg.trust_remote_code)
        del keep_alive
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss already divided by the global token count of the optimizer step.

        DeepSpeed averages gradients over DP ranks; multiplying by the DP size turns that average
        back into the sum over ranks. Gradient-accumulation scaling is switched off for the same reason.
        """
        self.engine.backward(loss * self.dp_size, scale_wrt_gas=False)

    def step(self) -> None:
        """Call after every micro-batch; DeepSpeed steps the optimizer at accumulation boundaries."""
        self.engine.step()

    def grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every parameter, gathering ZeRO-3 shards one module at a time.

        Collective under ZeRO-3: every rank of the DP group iterates it to the end, in the same order.
        Yielded tensors are private copies (valid after the gather is released).
        """
        for module_name, module in self.module.named_modules():
            params = list(module.named_parameters(recurse=False))
            if not params:
                continue
            gather = (deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
                      if self.zero_stage == 3 else nullcontext())
            with gather:
                copies = [(f"{module_name}.{n}" if module_name else n, p.detach().clone()) for n, p in params]
            yield from copies

    def save_hf(self, path: str, tokenizer, is_writer: bool) -> None:
        """Write the model in HF format (with the tokenizer). Collective: every DP rank calls it."""
        state = dict(self.full_parameters())
        if is_writer:
            self.module.save_pretrained(path, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(path)
