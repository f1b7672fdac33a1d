"""Streaming the actor's weights into every rank's rollout engine, bucket by bucket.

Actor ranks gather ZeRO-3 shards one module at a time (`DeepSpeedModel.full_parameters`; a LoRA actor
yields its merged weights under the base model's names and in its order, so the specs, read from the
unadapted model, hold for it too and only merged tensors travel). When some
ranks do not host the actor, the first actor rank packs parameters into flat buckets of at most
`bucket_bytes` and broadcasts each over the world; every rank unpacks and feeds its own engine. The
whole stream is one lazy iterator, because vLLM must receive all tensors of a fused module in one
reload call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """Specs in `DeepSpeedModel.full_parameters` order (modules in order, shared parameters once).
    Works on a meta-device model, so ranks without the actor can compute them."""
    seen: set[int] = set()
    specs = []
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            specs.append(ParamSpec(f"{module_name}.{name}" if module_name else name, tuple(p.shape), p.dtype))
    return specs


def meta_param_specs(model_path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> list[ParamSpec]:
    """Parameter specs of the HF causal LM at `model_path` without loading its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return param_specs(model)


def buckets(specs: list[ParamSpec], bucket_bytes: int) -> list[list[ParamSpec]]:
    """Consecutive specs (order kept) grouped so each group has one dtype and holds at most `bucket_bytes`
    (a larger tensor alone). A dtype change starts a new group, since a bucket is one flat tensor."""
    out: list[list[ParamSpec]] = [[]]
    size = 0
    for spec in specs:
        if out[-1] and (size + spec.num_bytes > bucket_bytes or spec.dtype != out[-1][0].dtype):
            out.append([])
            size = 0
        out[-1].append(spec)
        size += spec.num_bytes
    return [b for b in out if b]


def broadcast_parameters(local: Iterable[tuple[str, torch.Tensor]] | None, specs: list[ParamSpec], src: int,
                         bucket_bytes: int, device: torch.device,
                         group: dist.ProcessGroup | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every spec on every rank of `group`, broadcast from global rank `src`.

    Actor ranks pass their `full_parameters()` iterator (iterated in lockstep, as ZeRO-3 gathers are
    collective); other ranks pass None. Every rank of `group` must exhaust the iterator.
    """
    source = iter(local) if local is not None else None
    for bucket in buckets(specs, bucket_bytes):
        flat = torch.empty(sum(torch.Size(s.shape).numel() for s in bucket), dtype=bucket[0].dtype, device=device)
        if source is not None:
            offset = 0
            for spec in bucket:
                name, tensor = next(source)
                assert name == spec.name, (name, spec.name)
                flat[offset:offset + tensor.numel()] = tensor.reshape(-1).to(device)
                offset += tensor.numel()
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for spec in bucket:
            n = torch.Size(spec.shape).numel()
            yield spec.name, flat[offset:offset + n].view(spec.shape)
            offset += n


class CheckpointLayout:
    """The trainer model's tensors renamed (and split) into the layout of its checkpoint files, which is what
    vLLM's `load_weights` reads. transformers 5 fuses some families' weights in memory and writes the original
    layout on save (its conversion mapping): Mixtral's `mlp.experts.gate_up_proj` [E, 2I, H] is
    `block_sparse_moe.experts.{e}.w1/w3.weight` on disk, Qwen3-MoE's is `mlp.experts.{e}.gate_proj/up_proj.weight`.
    Each tensor is converted on its own, with transformers' own reverse conversion (`revert_weight_conversion`,
    what `save_pretrained` runs), so the stream stays lazy. A family without a conversion passes through as is."""

    def __init__(self, model_path: str | None, trust_remote_code: bool = False):
        self.meta = None
        if model_path is None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code, local_files_only=True)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        conversions = [c for c in get_model_conversion_mapping(meta, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
        if conversions:
            meta._weight_conversions = conversions
            self.meta = meta

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.meta is None:
            yield from named_tensors
            return
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in named_tensors:
            for converted_name, converted in revert_weight_conversion(self.meta, {name: tensor}).items():
                yield converted_name, converted.contiguous()
