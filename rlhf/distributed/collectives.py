"""Moving experience between roles with explicit collectives over named groups.

Every function says which ranks must call it. Shapes follow rlhf.data.records; B_local samples per
rank, B = world_size * B_local in rank order (so groups of one prompt stay contiguous).
"""

from __future__ import annotations

import math

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


def _as_int64_columns(t: torch.Tensor) -> torch.Tensor:
    """[B, W] int64 holding `t` ([B] or [B, W]; int64, or float32 by its bits) exactly."""
    t = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32).long()
    assert t.dtype == torch.int64, f"gathering a {t.dtype} rollout field"
    return t


def _from_int64_columns(columns: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`_as_int64_columns` undone: the rows of `columns` as tensors shaped and typed as `like`'s rows."""
    out = columns.int().view(torch.float32) if like.dtype == torch.float32 else columns.contiguous()
    return out.reshape(out.shape[0], *like.shape[1:])


def all_gather_rollout(rollout: Rollout, pad_id: int, group: dist.ProcessGroup | None = None) -> Rollout:
    """Concatenate every rank's rollout in rank order, padded to the longest sequence. Called by every rank of
    `group`; ranks may hold different numbers of samples (none, where an engine had no prompt). Three collectives
    whatever the fields (each costs about half a millisecond of latency on gloo): the ranks' sizes, every tensor
    field as columns of one int64 tensor (bit for bit), and the per-sample Python lists."""
    local = torch.tensor([rollout.sequences_BT.shape[1], rollout.num_samples])
    sizes = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, local, group=group)
    T = max(int(size[0]) for size in sizes)
    counts = [int(size[1]) for size in sizes]
    fields = [_pad_cols(rollout.sequences_BT, T, pad_id), _pad_cols(rollout.attention_mask_BT, T, 0),
              _pad_cols(rollout.action_mask_BT1, T - 1, 0.0), _pad_cols(rollout.rollout_logprobs_BT1, T - 1, 0.0),
              rollout.prompt_lens_B, rollout.response_lens_B]
    columns = [_as_int64_columns(f) for f in fields]
    gathered = _gather_rows(torch.cat(columns, dim=1), group, counts)
    ends = torch.tensor([c.shape[1] for c in columns]).cumsum(0).tolist()
    seq, attn, action, logprobs, prompt_lens, response_lens = (
        _from_int64_columns(gathered[:, end - c.shape[1]:end], f) for end, c, f in zip(ends, columns, fields))
    finish_reasons, prompts, responses, labels = zip(*_gather_list(
        [(rollout.finish_reasons, rollout.prompts, rollout.responses, rollout.labels)], group))
    return Rollout(sequences_BT=seq, attention_mask_BT=attn, action_mask_BT1=action, rollout_logprobs_BT1=logprobs,
                   prompt_lens_B=prompt_lens, response_lens_B=response_lens,
                   finish_reasons=[x for part in finish_reasons for x in part],
                   prompts=[x for part in prompts for x in part], responses=[x for part in responses for x in part],
                   labels=[x for part in labels for x in part])


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


def assemble(part: torch.Tensor | None, where: slice | torch.Tensor, shape: tuple[int, ...],
             group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full float32 tensor of `shape` whose rows are computed on different ranks.

    Each rank that computed rows `where` (a range, or row indices) passes them as `part`; ranks that computed
    nothing pass None.
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
