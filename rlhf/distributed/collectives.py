"""Moving experience between roles with explicit collectives over named groups.

Every function says which ranks must call it. Shapes follow rlhf.data.records; B_local samples per
rank, B = world_size * B_local in rank order (so groups of one prompt stay contiguous).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.data.records import Rollout


def shard(total: int, num_shards: int, index: int) -> slice:
    """Contiguous shard `index` of `total` items split into `num_shards` equal parts."""
    if total % num_shards:
        raise ValueError(f"{total} samples do not split evenly over {num_shards} ranks")
    size = total // num_shards
    return slice(index * size, (index + 1) * size)


def _pad_cols(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def _gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None, counts: list[int] | None = None) -> torch.Tensor:
    """Every rank's rows of `t` in rank order; `counts`: the ranks' row counts where they differ (rows are padded
    to the largest for the collective, then cut back)."""
    if counts is None or len(set(counts)) == 1:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)
    most = max(counts)
    padded = torch.cat([t, t.new_zeros((most - t.shape[0], *t.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def _gather_list(items: list, group: dist.ProcessGroup | None) -> list:
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, items, group=group)
    return [x for part in parts for x in part]


def all_gather_rollout(rollout: Rollout, pad_id: int, group: dist.ProcessGroup | None = None) -> Rollout:
    """Concatenate every rank's rollout in rank order, padded to the longest sequence. Called by every rank of
    `group`; ranks may hold different numbers of samples (none, where an engine had no prompt)."""
    local = torch.tensor([rollout.sequences_BT.shape[1], rollout.num_samples])
    sizes = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, local, group=group)
    T = max(int(size[0]) for size in sizes)
    counts = [int(size[1]) for size in sizes]
    return Rollout(
        sequences_BT=_gather_rows(_pad_cols(rollout.sequences_BT, T, pad_id), group, counts),
        attention_mask_BT=_gather_rows(_pad_cols(rollout.attention_mask_BT, T, 0), group, counts),
        action_mask_BT1=_gather_rows(_pad_cols(rollout.action_mask_BT1, T - 1, 0.0), group, counts),
        rollout_logprobs_BT1=_gather_rows(_pad_cols(rollout.rollout_logprobs_BT1, T - 1, 0.0), group, counts),
        prompt_lens_B=_gather_rows(rollout.prompt_lens_B, group, counts),
        response_lens_B=_gather_rows(rollout.response_lens_B, group, counts),
        finish_reasons=_gather_list(rollout.finish_reasons, group),
        prompts=_gather_list(rollout.prompts, group),
        responses=_gather_list(rollout.responses, group),
        labels=_gather_list(rollout.labels, group),
    )


def broadcast_rollout(rollout: Rollout | None, src: int, group: dist.ProcessGroup | None = None) -> Rollout:
    """Global rank `src`'s rollout on every rank of `group` (others pass None)."""
    holder = [rollout]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def select_rollout(rollout: Rollout, rows: list[int]) -> Rollout:
    """The samples `rows` of a rollout, in that order."""
    index = torch.tensor(rows, dtype=torch.long)
    return Rollout(
        sequences_BT=rollout.sequences_BT[index], attention_mask_BT=rollout.attention_mask_BT[index],
        action_mask_BT1=rollout.action_mask_BT1[index], rollout_logprobs_BT1=rollout.rollout_logprobs_BT1[index],
        prompt_lens_B=rollout.prompt_lens_B[index], response_lens_B=rollout.response_lens_B[index],
        finish_reasons=[rollout.finish_reasons[i] for i in rows], prompts=[rollout.prompts[i] for i in rows],
        responses=[rollout.responses[i] for i in rows],
        labels=[rollout.labels[i] for i in rows] if rollout.labels else [],
    )


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rollouts one after the other, padded to the longest sequence (no communication)."""
    T = max(p.sequences_BT.shape[1] for p in parts)
    return Rollout(
        sequences_BT=torch.cat([_pad_cols(p.sequences_BT, T, pad_id) for p in parts]),
        attention_mask_BT=torch.cat([_pad_cols(p.attention_mask_BT, T, 0) for p in parts]),
        action_mask_BT1=torch.cat([_pad_cols(p.action_mask_BT1, T - 1, 0.0) for p in parts]),
        rollout_logprobs_BT1=torch.cat([_pad_cols(p.rollout_logprobs_BT1, T - 1, 0.0) for p in parts]),
        prompt_lens_B=torch.cat([p.prompt_lens_B for p in parts]),
        response_lens_B=torch.cat([p.response_lens_B for p in parts]),
        finish_reasons=[x for p in parts for x in p.finish_reasons], prompts=[x for p in parts for x in p.prompts],
        responses=[x for p in parts for x in p.responses], labels=[x for p in parts for x in p.labels],
    )


def assemble(part: torch.Tensor | None, where: slice, shape: tuple[int, ...],
             group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full float32 tensor of `shape` whose row ranges are computed on different ranks.

    Each rank that computed rows `where` passes them as `part`; ranks that computed nothing pass None.
    Every row must be computed by exactly one rank. Called by every rank of `group` (the world).
    """
    full = torch.zeros(shape, dtype=torch.float32)
    if part is not None:
        full[where] = part.float()
    dist.all_reduce(full, group=group)
    return full


def broadcast_keys(keys: list[str] | None, src: int, group: dist.ProcessGroup | None = None) -> list[str]:
    """The list of names held by global rank `src`, on every rank of `group`."""
    holder = [keys]
    dist.broadcast_object_list(holder, src=src, group=group)
    return list(holder[0])
