"""Critic and reward models: an HF base model plus a scalar head named by `--value_head_prefix`.

The parameter layout is that of `AutoModelForSequenceClassification` with `num_labels=1`
(`<base_model_prefix>.*` + `<head>.weight`), so a saved model with the default head name `score`
loads there directly. Rewards are the head's output at the last non-pad token; critic values are
the head's output at every position. Knows nothing about DeepSpeed or RL.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlhf.models.layout import PADDED, SequenceLayout, position_ids_for
from rlhf.models.loading import check_local_model, check_packed_attention, exact_attention, quantization_config


class ScalarHeadModel(torch.nn.Module):
    """values_BT = head(base(input_ids).last_hidden_state)[..., 0] (float32)."""

    def __init__(self, base: torch.nn.Module, head_prefix: str) -> None:
        super().__init__()
        self.base_prefix = base.base_model_prefix
        self.head_prefix = head_prefix
        self.config = base.config
        self.name_or_path = base.name_or_path  # where the base came from (peft records it in adapter configs)
        setattr(self, self.base_prefix, base)
        setattr(self, head_prefix, torch.nn.Linear(base.config.hidden_size, 1, bias=False, dtype=base.dtype))

    @property
    def base(self) -> torch.nn.Module:
        return getattr(self, self.base_prefix)

    @property
    def head(self) -> torch.nn.Linear:
        return getattr(self, self.head_prefix)

    def get_input_embeddings(self) -> torch.nn.Module:
        """The base's (as HF models answer it; FLOP counting leaves it out)."""
        return self.base.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Per-token values, float32 with the leading shape of `input_ids`. Extra kwargs (packed or ring
        boundaries, see `SequenceLayout`) go to the base model."""
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_for(attention_mask)
        kwargs.setdefault("use_cache", False)
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           **kwargs).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.base.gradient_checkpointing_enable(**kwargs)


def token_values(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                 layout: SequenceLayout = PADDED) -> torch.Tensor:
    """float32 [B, T]: a scalar-head model's value at every position, in any layout (padding: 0 when packed)."""
    laid = layout.lay_out(sequences_BT, attention_mask_BT)
    return laid.to_padded(model(**laid.kwargs))


def last_token_values(values_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """[B]: the value at the last real token of each right-padded row (the sequence reward)."""
    last = attention_mask_BT.long().sum(-1) - 1
    return values_BT.gather(1, last[:, None]).squeeze(1)


def _head_weight(path: str, key: str) -> torch.Tensor | None:
    """Tensor `key` of the safetensors checkpoint at `path`, or None. Reads only that tensor (every rank
    calls this): the shard comes from the index's weight map when there is one, else from the headers."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shard = json.load(f)["weight_map"].get(key)
        shards = [shard] if shard is not None else []
    else:
        shards = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    for name in shards:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    return None


def checkpoint_keys(path: str) -> list[str]:
    """Every tensor name of the safetensors checkpoint at `path`, from the index or the file headers only."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(json.load(f)["weight_map"])
    keys: list[str] = []
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            keys.extend(f.keys())
    return sorted(keys)


def check_scalar_head(path: str, head_prefix: str, flag: str = "--reward_pretrain") -> None:
    """Raise ValueError unless the checkpoint at `path` holds `<head_prefix>.weight`: a reward model without
    its trained head would score with random weights. Reads only the index or safetensors headers."""
    keys = checkpoint_keys(path)
    if f"{head_prefix}.weight" in keys:
        return
    if not keys:
        raise ValueError(f"{flag} {path}: no safetensors weights found, so no value head "
                         f"'{head_prefix}.weight'; save the reward model with safe_serialization")
    tops: dict[str, int] = {}
    for key in keys:
        tops[key.split(".")[0]] = tops.get(key.split(".")[0], 0) + 1
    base = max(tops, key=tops.get)  # the base model's prefix holds nearly every tensor
    candidates = [k for k in keys if not k.startswith(base + ".")] or keys[-3:]
    raise ValueError(f"{flag} {path} has no value head '{head_prefix}.weight' (--value_head_prefix "
                     f"{head_prefix}); keys outside the base model: {', '.join(candidates[:8])}. Pass the head's "
                     "prefix with --value_head_prefix, or point the flag at a trained reward model, not a causal LM")


def load_scalar_head_model(path: str, head_prefix: str, dtype: torch.dtype, attn_implementation: str,
                           trust_remote_code: bool = False, flag: str = "--reward_pretrain",
                           fresh_head: bool = False, load_in_4bit: bool = False) -> ScalarHeadModel:
    """Base weights from `path` (a causal LM or a sequence-classification checkpoint) and the head
    `<head_prefix>.weight`. A missing head is a ValueError (see `check_scalar_head`) unless `fresh_head`
    (a critic may start from the policy): then it is initialised N(0, 1/(hidden+1)). `load_in_4bit`: the base's
    linear weights in 4-bit NF4 (QLoRA; the head stays in `dtype`)."""
    from transformers import AutoModel

    check_local_model(path, flag)
    check_packed_attention(path, attn_implementation, trust_remote_code, flag)
    if not fresh_head:
        check_scalar_head(path, head_prefix, flag)
    with _quiet_transformers():  # its load report lists a causal LM's lm_head as "unexpected": expected here
        base = AutoModel.from_pretrained(path, dtype=dtype,
                                         attn_implementation=exact_attention(path, attn_implementation,
                                                                             trust_remote_code),
                                         trust_remote_code=trust_remote_code, local_files_only=True,
                                         quantization_config=quantization_config(load_in_4bit))
    model = ScalarHeadModel(base, head_prefix)
    weight = _head_weight(path, f"{head_prefix}.weight")
    if weight is None:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(1, base.config.hidden_size, generator=generator) / (base.config.hidden_size + 1)
    with _full_param(model.head.weight), torch.no_grad():
        model.head.weight.copy_(weight.reshape(1, -1).to(dtype))
    return model


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings off (errors still shown) for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _full_param(param: torch.nn.Parameter):
    """A context in which `param` is whole: ZeRO-3 partitions parameters built under its Init, so the
    head is gathered (and re-partitioned from rank 0's copy) around the assignment."""
    if not hasattr(param, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)


def stored_reward_norm(path: str) -> tuple[float, float] | None:
    """(mean, std) that reward-model training stored in the checkpoint's config (OpenRLHF's "mean"/"std"
    keys), or None when it has none. Applied as (reward - mean) / std with --normalize_reward."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    mean, std = config.get("mean"), config.get("std")
    if isinstance(mean, (int, float)) and isinstance(std, (int, float)) and std > 0:
        return float(mean), float(std)
    return None


def save_scalar_head_model(state: dict[str, torch.Tensor], config, head_prefix: str, path: str,
                           tokenizer=None, extra_config: dict | None = None) -> None:
    """Write `state` (ScalarHeadModel parameter names) as a sequence-classification checkpoint."""
    os.makedirs(path, exist_ok=True)
    config = config.__class__.from_dict(config.to_dict())
    arch = config.architectures[0] if config.architectures else type(config).__name__.replace("Config", "")
    for suffix in ("ForCausalLM", "Model", "ForSequenceClassification"):
        arch = arch.removesuffix(suffix)
    config.architectures = [f"{arch}ForSequenceClassification"]
    config.num_labels = 1
    config.value_head_prefix = head_prefix
    for key, value in (extra_config or {}).items():
        setattr(config, key, value)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        json.load(f)  # fail here, not at load time, if the config did not serialise
