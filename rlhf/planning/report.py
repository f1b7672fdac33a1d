"""The `--dry_run` report: the rank plan, each rank's estimated peak memory per stage broken into its parts,
whether the job fits one device, and when it does not, the fewest flag changes that make it fit (each candidate
re-estimated, one change at a time, then pairs, and so on up to four); for the RL jobs, OpenRLHF's placement of
the same flags beside it. Reads the config only to name flags.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rlhf.distributed.topology import Role
from rlhf.planning.openrlhf_placement import comparison_lines
from rlhf.planning.peak_memory import COMPONENTS, GiB, JobMemory, estimate, total, with_training

SHORT = {"weights": "weights", "gradients": "grads", "optimizer": "optim", "activations": "activ",
         "logits": "logits", "frozen_models": "frozen", "rollout_weights": "rollout_w", "kv_cache": "kv_cache",
         "buffers": "buffers", "reserve": "reserve"}


def spans(ranks: tuple[int, ...]) -> str:
    """'0-3, 6' for (0, 1, 2, 3, 6)."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def rank_plan_lines(plan: dict[Role, tuple[int, ...]], ring: int, rollout_tp: int | None, tp: int = 1) -> list[str]:
    """Which roles on which ranks, their data-parallel, ring and tensor-parallel sizes, the rollout engines' TP
    groups."""
    lines = [f"rank plan ({len({r for ranks in plan.values() for r in ranks})} ranks):"]
    for role, ranks in plan.items():
        if role is Role.ROLLOUT:
            engine_tp = rollout_tp or 1
            groups = [ranks[i:i + engine_tp] for i in range(0, len(ranks), engine_tp)]
            lines.append(f"  rollout: {len(groups)} engine(s) of tensor-parallel size {engine_tp}"
                         + (f" (ranks {'; '.join(spans(g) for g in groups[:4])}{'; ...' if len(groups) > 4 else ''})"
                            if engine_tp > 1 else f" (ranks {spans(ranks)})"))
        else:
            lines.append(f"  {role.value}: ranks {spans(ranks)}, {len(ranks) // ring // tp} data-parallel replica(s)"
                         + (f", rings of {ring}" if ring > 1 else "")
                         + (f", tensor-parallel groups of {tp}" if tp > 1 else ""))
    return lines


def breakdown_table(per_stage: dict[str, dict[str, int]], unit: int) -> list[str]:
    """One row per stage, one column per part that is not zero anywhere, in `unit` bytes."""
    used = [c for c in COMPONENTS if any(b.get(c, 0) for b in per_stage.values())]
    head = f"    {'stage':<12}" + "".join(f"{SHORT[c]:>10}" for c in used) + f"{'total':>10}"
    rows = [f"    {stage:<12}" + "".join(f"{b.get(c, 0) / unit:>10.2f}" for c in used) + f"{total(b) / unit:>10.2f}"
            for stage, b in per_stage.items()]
    return [head, *rows]


def peak(job: JobMemory, world: int) -> tuple[int, int, str]:
    """(bytes, rank, stage) of the largest estimate over ranks and stages."""
    plan = estimate(job, world)
    top = max((total(b), -rank, stage) for rank, stages in plan.items() for stage, b in stages.items())
    return top[0], -top[1], top[2]


def candidates(cfg: Any, job: JobMemory) -> list[tuple[str, Callable[[JobMemory], JobMemory]]]:
    """(flag change, the job with it) for the changes that lower memory and are not set already."""
    t, e = job.training, cfg.engine
    out: list[tuple[str, Callable[[JobMemory], JobMemory]]] = []
    if t.zero_stage < 3:
        out.append(("--zero_stage 3", lambda j: with_training(j, zero_stage=3)))
    if not t.adam_offload:
        out.append(("--adam_offload", lambda j: with_training(j, adam_offload=True)))
    if not t.gradient_checkpointing:
        out.append(("--gradient_checkpointing", lambda j: with_training(j, gradient_checkpointing=True)))
    if e.use_dynamic_batch and e.train_max_tokens_per_gpu > 1:
        out.append((f"--train_max_tokens_per_gpu {e.train_max_tokens_per_gpu // 2}", halve_train_tokens))
    elif not e.use_dynamic_batch and cfg.batch.micro_train_batch_size > 1:
        out.append((f"--micro_train_batch_size {cfg.batch.micro_train_batch_size // 2}", halve_train_tokens))
    trained = [ranks for name, ranks in job.ranks.items() if job.models[name].trained]
    ring = 2 * t.ring_size
    if all(len(ranks) % ring == 0 for ranks in trained):
        out.append((f"--ring_attn_size {ring}", lambda j: with_training(j, ring_size=ring)))
    frozen = [m for m in job.models.values() if not m.trained]
    if frozen and not all(m.offload for m in frozen):
        out.append(("--ref_reward_offload" if job.rollout else "offloading the frozen model", offload_frozen))
    if job.rollout is not None and job.device_bytes is not None and job.rollout.vllm:
        if not job.rollout.sleep:
            out.append(("--vllm_enable_sleep", lambda j: replace(j, rollout=replace(j.rollout, sleep=True))))
        if job.rollout.gpu_fraction > 0.5:
            out.append(("--vllm_gpu_memory_utilization 0.5",
                        lambda j: replace(j, rollout=replace(j.rollout, gpu_fraction=0.5))))
    return out


def halve_train_tokens(job: JobMemory) -> JobMemory:
    stages = {s: tuple(replace(p, tokens=p.tokens // 2) if p.train else p for p in passes)
              for s, passes in job.stages.items()}
    return replace(job, stages=stages)


def offload_frozen(job: JobMemory) -> JobMemory:
    return replace(job, models={n: m if m.trained else replace(m, offload=True) for n, m in job.models.items()})


def fitting_changes(cfg: Any, job: JobMemory, world: int, budget: int, most: int = 3,
                    most_changes: int = 4) -> list[list[str]]:
    """The smallest sets of candidate changes (of at most `most_changes`; `most` sets of the fewest) under which
    the peak fits."""
    options = candidates(cfg, job)
    found: list[list[str]] = []
    for size in range(1, most_changes + 1):
        for combo in itertools.combinations(options, size):
            changed = job
            for _, change in combo:
                changed = change(changed)
            if peak(changed, world)[0] <= budget:
                found.append([label for label, _ in combo])
        if found:
            return found[:most]
    return found


def report(cfg: Any, job: JobMemory, plan: dict[Role, tuple[int, ...]], world: int) -> str:
    """The whole `--dry_run` printout: the memory plan, and for the RL jobs (which OpenRLHF places with Ray)
    OpenRLHF's placement of the same flags and what differs (`rlhf.planning.openrlhf_placement`)."""
    text = memory_report(cfg, job, plan, world)
    if hasattr(cfg, "rollout") and hasattr(cfg, "placement"):
        text += "\n" + "\n".join(comparison_lines(cfg, plan, world))
    return text


def memory_report(cfg: Any, job: JobMemory, plan: dict[Role, tuple[int, ...]], world: int) -> str:
    """The rank plan, the memory estimate per rank and stage, and whether (or with what changes) it fits."""
    lines = rank_plan_lines(plan, job.training.ring_size, job.rollout.tp if job.rollout else None,
                            job.training.tp_size)
    per_rank = estimate(job, world)
    groups: dict[str, list[int]] = {}
    for rank, stages in per_rank.items():  # ranks with the same estimate share a table
        groups.setdefault(repr(stages), []).append(rank)
    top, rank, stage = peak(job, world)
    unit, name = (GiB, "GiB") if top >= GiB else (1 << 20, "MiB")
    lines.append(f"estimated peak memory per rank and stage ({name}; model: rlhf/planning/peak_memory.py):")
    for ranks in groups.values():
        roles = [n for n, r in job.ranks.items() if ranks[0] in r] + (["rollout"] if job.rollout else [])
        lines.append(f"  ranks {spans(tuple(ranks))} ({', '.join(roles) or 'no models'}):")
        lines += breakdown_table(per_rank[ranks[0]], unit)
    if job.device_bytes is None:
        lines.append(f"peak {top / unit:.2f} {name} (rank {rank}, {stage}); no device to fit into: pass "
                     "--gpu_memory_gb to check a GPU's memory")
        return "\n".join(lines)
    budget = job.device_bytes
    if top <= budget:
        lines.append(f"fits: peak {top / GiB:.2f} GiB (rank {rank}, {stage}) of {budget / GiB:.0f} GiB per device")
        return "\n".join(lines)
    lines.append(f"does not fit: peak {top / GiB:.2f} GiB (rank {rank}, {stage}) > {budget / GiB:.0f} GiB per device")
    fixes = fitting_changes(cfg, job, world, budget)
    lines += ([f"  would fit with: {' + '.join(f)}" for f in fixes] if fixes else
              ["  no combination of up to four of the planner's changes fits: more ranks or a smaller model"])
    return "\n".join(lines)


def stage_estimates(job: JobMemory, world: int, rank: int) -> dict[str, int]:
    """This rank's estimated peak bytes per stage without the reserve (what measured peaks are compared with)."""
    return {stage: total(b, with_reserve=False) for stage, b in estimate(job, world)[rank].items()}

