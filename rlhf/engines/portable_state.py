"""Move a trained model's DeepSpeed state to another layout: another data-parallel size, ZeRO stage or
tensor-parallel size (--ds_tensor_parallel_size).

DeepSpeed's own checkpoint files are sharded by the layout that wrote them (ZeRO-1/2 flat partitions per
rank, ZeRO-3 per-parameter partitions, stage 0 whole), so a resume on another layout goes through a
rank-unaware form, DeepSpeed's *universal checkpoint*: one directory per parameter holding its full fp32
master weight and full Adam moments (`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`), plus the optimizer's
param groups (`zero/optimizer_state.pt`). `to_universal` converts a saved state once (DeepSpeed's
`ds_to_universal` for ZeRO and bf16 states; here for stage 0 in fp32, whose whole torch optimizer state sits
in the model-states file) and keeps it beside the state; a tensor-parallel state converts whole (DeepSpeed's
converter merges the slices by the partitions the AutoTP layers record; the stage-0 path calls its merge too).
`load_universal` sets every rank's share of the full tensors into an engine of any stage
(`deepspeed.utils.safe_set_full_*`; a layer split by AutoTP takes its rank's slice), with the LR schedule, the
optimizer's param groups and DeepSpeed's step counters. DeepSpeed's own universal loading covers only ZeRO-1/2
(measured: stage 0 and 3 engines fail), hence the loader here.

What moves exactly: weights and moments are the saved fp32 values, bit for bit; the run continues with
another reduction order (other partitions), so its later steps agree with an unmoved run's to float
rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shutil
from types import SimpleNamespace

import torch
import torch.distributed as dist

LAYOUT_FILE = "layout.json"
UNIVERSAL = "universal"
MOMENTS = ("exp_avg", "exp_avg_sq")


def write_layout(directory: str, *, zero_stage: int, dp_size: int, dtype: str, tp_size: int = 1) -> None:
    """Record the layout that wrote the engine state under `directory` (one rank calls it)."""
    with open(os.path.join(directory, LAYOUT_FILE), "w") as f:
        json.dump({"zero_stage": zero_stage, "dp_size": dp_size, "tp_size": tp_size, "dtype": dtype}, f)


def saved_layout(directory: str) -> dict | None:
    """The layout recorded by `write_layout`, or, for a state written before layouts were recorded, the one
    DeepSpeed's model-states file names (memory-mapped: its weights are not read); None when neither says."""
    path = os.path.join(directory, LAYOUT_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    try:
        model = _load(_model_states_file(os.path.join(directory, "state")))
    except (OSError, RuntimeError, ValueError):
        return None
    config = model.get("ds_config") or {}
    stage, dp_size = config.get("zero_optimization", {}).get("stage"), model.get("dp_world_size")
    if stage is None or not dp_size:
        return None
    enabled = lambda key: bool(config.get(key, {}).get("enabled"))  # noqa: E731
    return {"zero_stage": int(stage), "dp_size": int(dp_size), "tp_size": int(model.get("mp_world_size") or 1),
            "dtype": "bf16" if enabled("bf16") else "fp16" if enabled("fp16") else "fp32"}


def _load(path: str):
    """DeepSpeed's files hold pickled config objects: they are this run's own files, checked against the manifest.
    Memory-mapped: a model-states file read for its LR schedule and counters holds the whole module too."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _model_states_file(state_dir: str) -> str:
    files = sorted(glob.glob(os.path.join(state_dir, "*mp_rank_00_model_states.pt")))
    if not files:
        raise ValueError(f"{state_dir} holds no DeepSpeed model states (*mp_rank_00_model_states.pt)")
    return files[0]


def to_universal(directory: str, names: list[str]) -> str:
    """The universal form of the engine state under `directory/state`, written to `directory/universal` the
    first time (through a temporary directory renamed when complete) and reused after. `names`: the trainable
    parameters, in the module's order. One rank calls it."""
    out = os.path.join(directory, UNIVERSAL)
    if os.path.isdir(out):
        return out
    state_dir = os.path.join(directory, "state")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if glob.glob(os.path.join(state_dir, "*optim_states.pt")):
        from deepspeed.checkpoint import ds_to_universal

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
            ds_to_universal.main(SimpleNamespace(
                input_folder=state_dir, output_folder=os.path.join(tmp, "state"), num_extract_workers=1,
                num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    else:
        _stage0_to_universal(state_dir, os.path.join(tmp, "state"), names)
    os.replace(tmp, out)
    return out


def _stage0_to_universal(state_dir: str, out: str, names: list[str]) -> None:
    """Stage 0 without bf16: the module holds the fp32 weights and the torch optimizer's state dict, whose
    entries follow the trainable parameters' order (`names`), holds the moments. With tensor parallelism each
    tensor-parallel rank's model-states file holds its slices: they are merged whole as DeepSpeed's converter
    merges a ZeRO-1/2 state's (`merge_tp_slices`, by the partitions the AutoTP layers recorded in the file)."""
    files = sorted(glob.glob(os.path.join(state_dir, "mp_rank_*_model_states.pt")))
    if not files:
        raise ValueError(f"{state_dir} holds no DeepSpeed model states (mp_rank_*_model_states.pt)")
    models = [_load(file) for file in files]
    zero = os.path.join(out, "zero")
    slices = os.path.join(out, "tp_slices")  # the converter's layout: <name>/<tp rank>/<state>.<dp rank>
    for tp_rank, model in enumerate(models):
        optim = model["optimizer"]
        absent = [n for n in names if n not in model["module"]]
        if absent:
            raise ValueError(f"{state_dir} holds no weights for {', '.join(absent[:3])}: the checkpoint is another "
                             "model's")
        order = [i for group in optim["param_groups"] for i in group["params"]]
        if len(order) != len(names):
            raise ValueError(f"{state_dir}: {len(names)} trainable parameters but {len(order)} optimizer entries")
        for index, name in zip(order, names):
            entry = {"fp32": model["module"][name].float(), **optim["state"].get(index, {})}
            if len(models) == 1:  # whole already
                os.makedirs(os.path.join(zero, name))
                for key in ("fp32", *MOMENTS):
                    if key in entry:
                        torch.save({"param": entry[key]}, os.path.join(zero, name, f"{key}.pt"))
                if "step" in entry:
                    torch.save(entry["step"], os.path.join(zero, name, "step.pt"))
                continue
            os.makedirs(os.path.join(slices, name, str(tp_rank)))
            for key in ("fp32", *MOMENTS, "step"):
                if key in entry:
                    value = entry[key].flatten() if key != "step" else entry[key]
                    torch.save(value, os.path.join(slices, name, str(tp_rank), f"{key}.00"))
    if len(models) > 1:
        from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

        info = models[0].get("universal_checkpoint_info")
        if not info:
            raise ValueError(f"{state_dir}: {len(models)} tensor-parallel model files but no record of how their "
                             "layers were split (universal_checkpoint_info)")
        for name in names:
            shapes = [tuple(model["module"][name].shape) for model in models]
            merge_tp_slices(info, zero, slices, len(models), (name, shapes))
        shutil.rmtree(slices)
    optim = models[0]["optimizer"]
    torch.save({"param_groups": optim["param_groups"]}, os.path.join(zero, "optimizer_state.pt"))
    shutil.copy(files[0], os.path.join(out, "mp_rank_00_model_states.pt"))


def _zero_optimizer(engine):
    """DeepSpeed's wrapper optimizer (ZeRO or bf16), or None when the engine steps a torch optimizer itself."""
    optimizer = engine.optimizer
    return optimizer if hasattr(optimizer, "optimizer") else None


def _stepped(engine, zero_stage: int) -> tuple[torch.optim.Optimizer, list[list[torch.Tensor]]]:
    """The torch optimizer and, per param group, the tensors it steps: the module's parameters (stage 0 in
    fp32), DeepSpeed's flat fp32 partitions (ZeRO-1/2, bf16), or its fp32 sub-group partitions (ZeRO-3, whose
    param groups are emptied between steps)."""
    wrapper = _zero_optimizer(engine)
    if wrapper is None:
        return engine.optimizer, [group["params"] for group in engine.optimizer.param_groups]
    if zero_stage == 3:
        return wrapper.optimizer, [list(wrapper.fp32_partitioned_groups_flat)]
    return wrapper.optimizer, [group["params"] for group in wrapper.optimizer.param_groups]


def _materialise_states(engine, zero_stage: int) -> None:
    """Create AdamW's per-tensor states (torch creates them lazily at the first step) on the tensors the
    optimizer steps, then let DeepSpeed link each parameter to its share of them (ZeRO-1/2, bf16)."""
    inner, groups = _stepped(engine, zero_stage)
    for tensors in groups:
        for t in tensors:
            state = inner.state[t]
            state.setdefault("step", torch.tensor(0.0))
            for key in MOMENTS:
                state.setdefault(key, torch.zeros_like(t, memory_format=torch.preserve_format))
    wrapper = _zero_optimizer(engine)
    if wrapper is not None and hasattr(wrapper, "_lazy_init_hp_params_optimizer_state"):
        wrapper._hp_optimizer_states_linked = False
        wrapper._lazy_init_hp_params_optimizer_state()


def load_universal(engine, scheduler, universal: str, *, zero_stage: int,
                   params: list[tuple[str, torch.nn.Parameter]], tp_rank: int = 0, tp_size: int = 1) -> None:
    """Set the universal state under `universal` into `engine` (any stage and DP size, and any tensor-parallel
    size below ZeRO-3): every trainable parameter's fp32 master weight and Adam moments (a layer split by AutoTP
    takes its rank's slice, `_tensor_parallel_slice`), the low-precision weights, the Adam step, the param groups,
    the LR schedule and DeepSpeed's step counters. Collective over the engine's DP group (ZeRO-3 gathers)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero_dir = os.path.join(universal, "state", "zero")
    model = _load(_model_states_file(os.path.join(universal, "state")))
    saved_optimizer = _load(os.path.join(zero_dir, "optimizer_state.pt"))
    missing = [name for name, _ in params if not os.path.isdir(os.path.join(zero_dir, name))]
    if missing:
        raise ValueError(f"{universal}: no saved state for {len(missing)} of this model's trainable parameters "
                         f"({', '.join(missing[:3])}...): the checkpoint is another model's")
    _materialise_states(engine, zero_stage)
    wrapper = _zero_optimizer(engine)
    steps = set()
    for name, p in params:
        fp32 = _tensor_parallel_slice(p, _tensor(os.path.join(zero_dir, name, "fp32.pt")), "fp32", tp_rank, tp_size)
        moments = {k: _tensor_parallel_slice(p, _tensor(os.path.join(zero_dir, name, f"{k}.pt")), k, tp_rank, tp_size)
                   for k in MOMENTS}
        step_file = os.path.join(zero_dir, name, "step.pt")
        if os.path.isfile(step_file):
            steps.add(float(_load(step_file)))
        if wrapper is None:  # the module's parameters are the fp32 master weights the torch optimizer steps
            with torch.no_grad():
                p.copy_(fp32.view_as(p))
            for key, value in moments.items():
                engine.optimizer.state[p][key].copy_(value.view_as(p))
            continue
        if zero_stage == 3:
            for key, value in {None: fp32, **moments}.items():
                _set_zero3_partition(wrapper, p, value, key)
            continue
        safe_set_full_fp32_param(p, fp32.view_as(p))
        for key, value in moments.items():
            safe_set_full_optimizer_state(p, value.view_as(p), key)
    # ZeRO-3 conversions keep the Adam step in the optimizer's own state dict, not beside each parameter
    entries = saved_optimizer.get("optimizer_state_dict", {}).get("state", {}).values()
    steps |= {float(entry["step"]) for entry in entries if "step" in entry}
    if len(steps) != 1:
        raise ValueError(f"{universal}: the parameters were saved at Adam steps {sorted(steps)}, not one step")
    step = steps.pop()
    inner, stepped = _stepped(engine, zero_stage)
    for group, saved in zip(inner.param_groups, saved_optimizer["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for t in (t for tensors in stepped for t in tensors):
        inner.state[t]["step"] = torch.tensor(step)
    if wrapper is not None:
        _copy_masters_to_model(engine, zero_stage)
    if scheduler is not None and model.get("lr_scheduler") is not None:
        scheduler.load_state_dict(model["lr_scheduler"])
    for counter in ("global_steps", "global_samples", "skipped_steps"):
        if counter in model:
            setattr(engine, counter, model[counter])


def _tensor(path: str) -> torch.Tensor:
    """A universal checkpoint's tensor file: {"param": tensor} (ZeRO-1/2 conversions) or the tensor (ZeRO-3)."""
    value = _load(path)
    return value["param"] if isinstance(value, dict) else value


def _tensor_parallel_slice(p: torch.nn.Parameter, full: torch.Tensor, key: str, tp_rank: int,
                           tp_size: int) -> torch.Tensor:
    """`p`'s share of a saved whole tensor: the whole tensor, or, where AutoTP split `p`'s layer over `tp_size`
    ranks, rank `tp_rank`'s slice as DeepSpeed's own universal loader cuts it (the layer's recorded partition)."""
    if tp_size == 1 or full.numel() == p.numel() and full.shape == p.shape:
        return full
    from deepspeed.checkpoint.universal_checkpoint import _resolve_autotp_partition

    part = _resolve_autotp_partition(p, {}, full, tp_rank, tp_size, state_key=key)
    if part is None or part.numel() != p.numel():
        raise ValueError(f"a saved tensor of shape {tuple(full.shape)} does not split into this rank's "
                         f"{tuple(p.shape)} over {tp_size} tensor-parallel ranks")
    return part


def _set_zero3_partition(wrapper, p: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """This rank's partition of `p`'s fp32 master (`key` None) or Adam moment from the full `value`. DeepSpeed's
    `set_full_hp_param` cuts the last partition of a padded parameter past the tensor's end (measured: a 3-element
    bias over 2 ranks fails), so the value is padded to the partitions' total first."""
    if value.numel() != p.ds_numel:
        raise ValueError(f"a saved tensor of {value.numel()} elements for a parameter of {p.ds_numel}")
    part, _ = wrapper._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
    rank = wrapper._get_param_partition_rank(p)
    flat = value.flatten().to(part.dtype)
    flat = torch.nn.functional.pad(flat, (0, max(0, part.numel() * (rank + 1) - flat.numel())))
    part.data.copy_(flat.narrow(0, part.numel() * rank, part.numel()))


def _copy_masters_to_model(engine, zero_stage: int) -> None:
    """The module's (low-precision) weights from the fp32 masters just set, as DeepSpeed does after a step."""
    wrapper = engine.optimizer
    if zero_stage == 3:
        for i in range(len(wrapper.fp16_partitioned_groups_flat)):
            wrapper.fp16_partitioned_groups_flat[i].data.copy_(wrapper.fp32_partitioned_groups_flat[i].data)
        if hasattr(wrapper, "invalidate_secondary_tensor"):  # ZeRO++'s secondary copies are stale now
            wrapper.invalidate_secondary_tensor()
    else:  # ZeRO-1/2 and the bf16 optimizer: copy this rank's partition, all-gather the flat groups
        wrapper.update_lp_params()
    dist.barrier(group=getattr(wrapper, "dp_process_group", None))
