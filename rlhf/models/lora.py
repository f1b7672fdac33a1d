"""LoRA and QLoRA adapters (peft) on trainable models, and the merged view of an adapted model.

`apply_lora` wraps a loaded causal LM or `ScalarHeadModel` in a peft `PeftModel` (the scalar head stays fully
trainable and is saved with the adapter, via `modules_to_save`). `merged_parameters` streams an adapted model's
weights as the base model would hold them (W + scale x B @ A, under the base model's parameter names): what the
rollout engine loads and what a full state dict holds. `save_adapter` writes what OpenRLHF writes for a LoRA
model (adapter_config.json, adapter_model.safetensors, config.json, tokenizer) and `adapter_base.json`, a
fingerprint of the base's weights (`weights_fingerprint`); `merge_adapter` is the inverse used by
`rlhf.cli.lora_combiner`, which checks its base against that record. Knows nothing of DeepSpeed: callers pass
the gather that makes a ZeRO-3 module's parameters whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlhf.config.errors import UsageError
from rlhf.config.shared_config import LoRAConfig

ADAPTER = "default"
"""peft's name of the one adapter a model carries here."""

PEFT_PREFIX = "base_model.model."
"""What peft puts in front of the base model's parameter names."""

BASE_RECORD = "adapter_base.json"
"""The file `save_adapter` writes beside an adapter: {"base_model_name_or_path": the base's absolute path,
"weights_fingerprint": `weights_fingerprint` of it, or null}."""

Gather = Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager]
"""A context in which the given parameters are whole (ZeRO-3: a collective gather; else nothing)."""


def check_lora(cfg: LoRAConfig) -> None:
    """UsageError unless the adapter settings can run here: --load_in_4bit needs CUDA and bitsandbytes
    (its 4-bit kernels are GPU kernels). Run before any engine starts."""
    if cfg.load_in_4bit:
        check_4bit("(--lora_rank alone trains LoRA adapters on CPU)")


def check_4bit(cpu_hint: str = "") -> None:
    """UsageError naming --load_in_4bit unless bitsandbytes' 4-bit weights can run here (CUDA and the package);
    `cpu_hint`: what to do instead on a machine without CUDA."""
    if not torch.cuda.is_available():
        raise UsageError("--load_in_4bit needs a CUDA GPU: bitsandbytes' 4-bit weights have no CPU path; drop "
                         f"--load_in_4bit on this machine{' ' + cpu_hint if cpu_hint else ''}")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError("--load_in_4bit needs the bitsandbytes package: pip install bitsandbytes (the gpu extra "
                         "installs it)")


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether any parameter of `module` is a bitsandbytes 4-bit parameter."""
    return any(type(p).__name__ == "Params4bit" for p in module.parameters())


def is_adapted(module: torch.nn.Module) -> bool:
    """Whether `module` is a peft model (its trainable parameters are adapters). Never imports peft: without
    it imported there is no peft model."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def _target_modules(cfg: LoRAConfig) -> str | list[str]:
    # peft expands only the string "all-linear" (a list holding it would match no module)
    return "all-linear" if tuple(cfg.target_modules) == ("all-linear",) else list(cfg.target_modules)


def apply_lora(module: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """`module` (a causal LM, or a `ScalarHeadModel` whose head stays trainable) with LoRA adapters on
    --target_modules; every other parameter is frozen. With --load_in_4bit the module must have been loaded
    quantised (`rlhf.models.loading.quantization_config`): it is prepared for k-bit training (peft's
    `prepare_model_for_kbit_training`) first, and after wrapping every parameter that is not 4-bit is in bf16,
    the compute dtype."""
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    from rlhf.models.value import ScalarHeadModel

    if cfg.load_in_4bit:
        if not is_quantized(module):
            raise ValueError("--load_in_4bit: this job's model loader did not quantise the model (pass "
                             "quantization_config(load_in_4bit) to from_pretrained)")
        module = prepare_model_for_kbit_training(module, use_gradient_checkpointing=False)
    head = module.head_prefix if isinstance(module, ScalarHeadModel) else None
    config = LoraConfig(
        task_type=None if head else TaskType.CAUSAL_LM, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout, target_modules=_target_modules(cfg), bias="none",
        exclude_modules=[head] if head else None, modules_to_save=[head] if head else None)
    try:
        model = get_peft_model(module, config)
    except ValueError as err:
        raise UsageError(f"--target_modules {' '.join(cfg.target_modules)}: {err}") from err
    if cfg.load_in_4bit:
        _to_compute_dtype(model)
    return model


def _to_compute_dtype(model: torch.nn.Module) -> None:
    """Every floating-point (not 4-bit) parameter in bf16. `prepare_model_for_kbit_training` leaves them in fp32;
    DeepSpeed's bf16 mode casts them to bf16 when the engine starts (so OpenRLHF's fp32 norms do not survive
    either); doing it here keeps the module consistent before that too (fp32 norms feeding a bf16 output layer
    fail outside DeepSpeed)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)


def base_name(peft_name: str) -> str:
    """The base model's name of a parameter of an adapted model: `base_model.model.` dropped, `.base_layer`
    removed, a saved module's trained copy named as the module."""
    name = peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
    return name.replace(f".modules_to_save.{ADAPTER}.", ".")


def _dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor (4-bit weights dequantised)."""
    if type(weight).__name__ == "Params4bit":
        from peft.utils.integrations import dequantize_bnb_weight

        return dequantize_bnb_weight(weight)
    return weight.detach()


def _adapter_deltas(layer) -> dict[str, list[torch.Tensor]]:
    """Parameter name of the innermost base layer -> the deltas (fp32) of the LoRA wrappers around it. A linear
    layer's adapter targets its `weight`; peft's `ParamWrapper`s target a named parameter, and wrap one another
    when several parameters of one module are adapted (transformers 5's fused MoE experts: `gate_up_proj` and
    `down_proj` of one experts module, the router's `weight`)."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, list[torch.Tensor]] = {}
    wrapper = layer
    while isinstance(wrapper, LoraLayer):
        if ADAPTER in wrapper.lora_A:
            target = getattr(wrapper, "parameter_name", None) or "weight"
            deltas.setdefault(target, []).append(wrapper.get_delta_weight(ADAPTER).float())
        wrapper = wrapper.base_layer
    return deltas


def _lora_merged(layer, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of a LoRA layer's base parameters with the adapters' deltas added to the parameters they
    target (summed in fp32, cast back to the parameter's dtype; a 4-bit weight is dequantised to its compute dtype
    first)."""
    deltas = _adapter_deltas(layer)
    out = []
    for name, p in layer.get_base_layer().named_parameters(recurse=False):
        dense = _dense(p)
        if name in deltas:
            merged = dense.float()
            for delta in deltas.pop(name):
                merged = merged + delta.reshape(dense.shape)
            dense = merged.to(dense.dtype)
        out.append((f"{prefix}{name}", dense.clone()))
    if deltas:
        raise RuntimeError(f"{prefix}: LoRA adapters on {sorted(deltas)}, which the base layer does not hold")
    return out


def merged_parameters(model: torch.nn.Module, gather: Gather, keep: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, full tensor) of every parameter of the base model, the adapters merged in, in the order of
    the base model's own modules (shared parameters once), one module at a time: the order
    `rlhf.engines.weight_sync.param_specs` gives the unadapted model. `gather(params)` makes a module's
    parameters whole (collective under ZeRO-3: every rank iterates to the end). `keep=False`: take part in
    the gathers, yield nothing. 4-bit base weights come dequantised."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    seen: set[int] = set()
    skip: str | None = None  # the subtree already emitted through its LoRA layer or saved-module wrapper
    for module_name, module in model.named_modules():
        if skip is not None and module_name.startswith(skip):
            continue
        skip = None
        prefix = base_name(f"{module_name}.") if module_name else ""
        if isinstance(module, LoraLayer):
            params = [p for p in module.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            skip = f"{module_name}."
            with gather(params):
                merged = _lora_merged(module, prefix) if keep else []
            yield from merged
            continue
        if isinstance(module, ModulesToSaveWrapper):
            module = module.modules_to_save[ADAPTER]
            skip = f"{module_name}."
            named = list(module.named_parameters())
        else:
            named = list(module.named_parameters(recurse=False))
        named = [(n, p) for n, p in named if id(p) not in seen]
        seen.update(id(p) for _, p in named)
        if not named:
            continue
        with gather([p for _, p in named]):
            copies = [(f"{prefix}{n}", _dense(p).clone()) for n, p in named] if keep else []
        yield from copies


def adapter_state_dict(model: torch.nn.Module, gather: Gather, keep: bool = True) -> dict[str, torch.Tensor]:
    """The trainable parameters (adapters and saved modules) under the adapted model's own names, whole.
    Collective under ZeRO-3 (every rank calls it); {} where not `keep`."""
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            with gather([p]):
                if keep:
                    state[name] = p.detach().clone()
    return state


def save_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str, tokenizer=None,
                 extra_config: dict[str, Any] | None = None) -> None:
    """What OpenRLHF saves for a LoRA model: adapter_config.json and adapter_model.safetensors (the adapters
    and saved modules of `state`, see `adapter_state_dict`), the base model's config.json (with
    `extra_config` added) and the tokenizer; and `BASE_RECORD`, where the base came from and its weights'
    fingerprint (read from its files, so ZeRO-3 partitioned weights need no gather). Call on one rank."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
    base = model.get_base_model()
    config = base.config.__class__.from_dict({**base.config.to_dict(), **(extra_config or {})})
    config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    base_path = os.path.abspath(base.name_or_path) if base.name_or_path else None
    with open(os.path.join(path, BASE_RECORD), "w") as f:
        json.dump({"base_model_name_or_path": base_path,
                   "weights_fingerprint": weights_fingerprint(base_path) if base_path else None}, f, indent=2)


def _sampled_rows(handle, key: str, shape: list[int]) -> torch.Tensor:
    """Tensor `key` of the open safetensors file `handle`, flat: whole when it holds at most 4096 values, else
    the first 4096 of a 1-D tensor, else its first, middle and last rows along the first dimension (of a tensor
    with more than two dimensions, the rows of its first inner matrix)."""
    if math.prod(shape) <= 4096:
        return handle.get_tensor(key).reshape(-1)
    tensor_slice = handle.get_slice(key)
    if len(shape) == 1:
        return tensor_slice[:4096]
    inner = (slice(0, 1),) * (len(shape) - 2)
    rows = sorted({0, shape[0] // 2, shape[0] - 1})
    return torch.cat([tensor_slice[(slice(i, i + 1), *inner)].reshape(-1) for i in rows])


def weights_fingerprint(path: str) -> str | None:
    """A fingerprint of the weights of the safetensors checkpoint in directory `path` (None when it holds no
    .safetensors file): sha256 over every tensor's name and shape and its first, middle and last rows rounded
    to bf16, in name order. It tells two checkpoints of the same architecture apart (a fine-tune changes every
    row) while reading a few rows a tensor, and does not change with the shard layout or with a conversion
    between fp32 and bf16."""
    from safetensors import safe_open

    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors")) if os.path.isdir(path) else []
    if not files:
        return None
    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(os.path.join(path, n), framework="pt")) for n in files]
        owner = {key: handle for handle in handles for key in handle.keys()}
        for key in sorted(owner):
            shape = list(owner[key].get_slice(key).get_shape())
            sample = _sampled_rows(owner[key], key, shape).to(torch.bfloat16)
            digest.update(f"{key}{shape}".encode())
            digest.update(sample.contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def read_base_record(path: str) -> dict[str, Any]:
    """The `adapter_base.json` beside the adapter at `path`, or {} when it has none (an adapter saved elsewhere,
    or before this record was written)."""
    file = os.path.join(path, BASE_RECORD)
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def read_adapter_config(path: str, flag: str = "--lora_path") -> dict[str, Any]:
    """The adapter_config.json under `path` (ValueError naming `flag` when there is none)."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{flag} {path}: no adapter_config.json; point it at the directory a --lora_rank run "
                         "saved (--save_path, or a checkpoint's hf directory with --save_hf_ckpt)")
    with open(file) as f:
        return json.load(f)


def merge_adapter(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """`model` (the base the adapter at `path` was trained on) with the adapter merged into its weights and
    its saved modules (a scalar head) in place: a plain module again."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, path, is_trainable=False).merge_and_unload()
