"""Context-parallel ("ring") attention over packed sequences: each rank of an explicitly passed
sequence-parallel group holds a zigzag shard of every sequence, K/V blocks travel around the ring, and
partial results are merged with their log-sum-exp; the backward sends dK/dV accumulators around the
ring with the blocks. It owns the zigzag layout (shard/unshard) and knows nothing about models.

Shape legend: G global packed tokens, N = G / W local tokens of one rank, W ring size (group size),
H query heads, K kv heads, R = H // K query heads per kv head, D head dim, S sequences, M kv tokens of a
block. Inner tensors are laid out [K, R, N, D] so grouped-query attention never repeats K/V.

Zigzag: every segment of the global packed row is cut into 2W equal chunks and rank r holds chunks r
and 2W-1-r (in that order), so under a causal mask every rank does the same work. Segments must be a
multiple of 2W long: pack with `pad_to_multiple_of=2 * W` (padding sits at segment ends, so real
tokens never attend to it). Local boundaries are `cu_seqlens // W`.

Block kernels: on CUDA with fp16/bf16 inputs each block is PyTorch's built-in FlashAttention-2 varlen
kernel (`flash_ops`: its log-sum-exp output merges the blocks, its backward takes the final output and
log-sum-exp); elsewhere (CPU, fp32, pre-Ampere) plain PyTorch blocks with fp32 accumulation
(`block_kernel_for` says which runs). Both accumulate the output and dK/dV across blocks in fp32.
Sliding windows and logit soft-capping (`window`, `softcap`, as in `varlen_attention`) run on the einsum
blocks: the window is a mask over global positions, the soft-cap bends each block's scores (and its backward
multiplies by the tanh's derivative); the flash blocks take neither.
`head_stride` is this module's reading of OpenRLHF's `--ring_head_stride` (kv heads per
communication step in ring-flash-attn): the ring pass runs once per group of `head_stride` kv heads,
so communication buffers and score blocks hold only that many heads at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import flash_ops
from .packing import position_ids_from_cu, segment_ids_from_cu, seqlens_from_cu
from .varlen_attention import check_attention_variants

# ---- zigzag layout -------------------------------------------------------------------------------


def check_zigzag_lengths(cu_seqlens: torch.Tensor, ring_size: int) -> None:
    """ValueError unless every segment length is a positive multiple of 2 * ring_size."""
    bad = [n for n in seqlens_from_cu(cu_seqlens) if n <= 0 or n % (2 * ring_size)]
    if bad:
        raise ValueError(f"ring attention over {ring_size} ranks needs every packed segment to be a multiple of "
                         f"{2 * ring_size} tokens (got {bad}); pack with pad_to_multiple_of={2 * ring_size}")


def zigzag_indices(cu_seqlens: torch.Tensor, rank: int, ring_size: int) -> torch.Tensor:
    """int64 [G / W]: global packed positions held by `rank`, chunk r then chunk 2W-1-r of each segment."""
    check_zigzag_lengths(cu_seqlens, ring_size)
    bounds = cu_seqlens.tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * ring_size)
        for c in (rank, 2 * ring_size - 1 - rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces).to(cu_seqlens.device)


def zigzag_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, ring_size: int, dim: int = 0) -> torch.Tensor:
    """This rank's zigzag shard of a packed tensor whose `dim` runs over the G global tokens."""
    return x.index_select(dim, zigzag_indices(cu_seqlens, rank, ring_size).to(x.device))


def zigzag_unshard(shards: list[torch.Tensor], cu_seqlens: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of `zigzag_shard` given every rank's shard in rank order (differentiable)."""
    ring_size = len(shards)
    order = torch.cat([zigzag_indices(cu_seqlens, r, ring_size) for r in range(ring_size)])
    return torch.cat(shards, dim).index_select(dim, torch.argsort(order).to(shards[0].device))


def zigzag_local_cu_seqlens(cu_seqlens: torch.Tensor, ring_size: int) -> torch.Tensor:
    """int32 [S + 1] boundaries of the local shard (every segment keeps 1/W of its tokens)."""
    check_zigzag_lengths(cu_seqlens, ring_size)
    return (cu_seqlens // ring_size).to(torch.int32)


@dataclass(frozen=True)
class _RingLayout:
    """Global position and segment of every local token of every rank, and the zigzag block plan."""

    rank: int
    ring_size: int
    causal: bool
    window: int | None
    position_WN: torch.Tensor
    segment_WN: torch.Tensor
    first_half_N: torch.Tensor
    second_half_N: torch.Tensor
    local_cu: torch.Tensor  # int32 [S + 1]: the local shard's segments
    half_cu: torch.Tensor  # int32 [S + 1]: half of each local segment (one zigzag chunk)
    max_local: int
    max_half: int

    @staticmethod
    def build(cu_seqlens: torch.Tensor, rank: int, ring_size: int, causal: bool,
              device: torch.device, window: int | None = None) -> _RingLayout:
        cu = cu_seqlens.to(device)
        position_WN = torch.stack([zigzag_indices(cu, r, ring_size) for r in range(ring_size)])
        segment_WN = segment_ids_from_cu(cu)[position_WN]
        local_cu = zigzag_local_cu_seqlens(cu, ring_size)
        half_len_N = ((local_cu[1:] - local_cu[:-1]) // 2).long()[segment_ids_from_cu(local_cu)]
        is_first_N = position_ids_from_cu(local_cu) < half_len_N  # chunk r; the rest is chunk 2W-1-r
        max_local = int((local_cu[1:] - local_cu[:-1]).max())
        return _RingLayout(rank, ring_size, causal, window, position_WN, segment_WN,
                           is_first_N.nonzero().squeeze(-1), (~is_first_N).nonzero().squeeze(-1),
                           local_cu, (local_cu // 2).to(torch.int32), max_local, max_local // 2)

    def block(self, src: int) -> tuple[slice | torch.Tensor, slice | torch.Tensor]:
        """(query rows, kv columns) with any visible pair when our queries meet rank `src`'s K/V block.

        Causal zigzag: src < rank -> only src's first chunks are visible (to all our rows); src > rank ->
        only our second chunks see anything (all of src's block); src == rank -> the local causal block.
        """
        everything = slice(None)
        if not self.causal or src == self.rank:
            return everything, everything
        if src < self.rank:
            return everything, self.first_half_N
        return self.second_half_N, everything

    def varlen(self, src: int) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
        """The block of `block(src)` as a varlen kernel call: (cu_q, cu_k, max_q, max_k, causal). Every row
        of a block sees either all of its segment's columns or (src == rank, causal) a causal prefix."""
        full = (self.local_cu, self.local_cu, self.max_local, self.max_local)
        if not self.causal:
            return (*full, False)
        if src == self.rank:
            return (*full, True)
        if src < self.rank:  # all our rows, src's first chunks
            return self.local_cu, self.half_cu, self.max_local, self.max_half, False
        return self.half_cu, self.local_cu, self.max_half, self.max_local, False  # our second chunks, all of src

    def visible(self, src: int, rows: slice | torch.Tensor, cols: slice | torch.Tensor) -> torch.Tensor:
        """bool [rows, cols]: same segment, (causal) key position <= query position, and (window) fewer than
        `window` positions back."""
        q_pos, k_pos = self.position_WN[self.rank][rows], self.position_WN[src][cols]
        mask = self.segment_WN[self.rank][rows][:, None] == self.segment_WN[src][cols][None, :]
        if self.causal:
            mask &= k_pos[None, :] <= q_pos[:, None]
        if self.window is not None:
            mask &= q_pos[:, None] - k_pos[None, :] < self.window
        return mask


# ---- block math (fp32) ---------------------------------------------------------------------------


# Query rows per score tile: bounds the float32 [K, R, rows, M] temporaries of one block.
ROWS_PER_TILE = 512


def _scores(q_KRnD: torch.Tensor, k_KMD: torch.Tensor, scale: float, softcap: float | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores [K, R, n, M], tanh of the capped scores or None): q.k * scale, soft-capped when softcap is set."""
    scores = torch.einsum("krnd,kmd->krnm", q_KRnD, k_KMD).mul_(scale)
    if softcap is None:
        return scores, None
    tanh = scores.div_(softcap).tanh_()
    return tanh * softcap, tanh


def _block_forward(q_KRND: torch.Tensor, k_KMD: torch.Tensor, v_KMD: torch.Tensor, visible_NM: torch.Tensor,
                   scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against one K/V block: (normalised output [K, R, N, D], log-sum-exp [K, R, N])."""
    k, v = k_KMD.float(), v_KMD.float()
    outs, lses = [], []
    for r0 in range(0, q_KRND.shape[2], ROWS_PER_TILE):
        rows = slice(r0, r0 + ROWS_PER_TILE)
        scores, _ = _scores(q_KRND[:, :, rows].float(), k, scale, softcap)
        scores.masked_fill_(~visible_NM[rows], float("-inf"))
        row_max = _finite(scores.amax(dim=-1, keepdim=True))
        probs = scores.sub_(row_max).exp_()  # in place; rows with no visible key are all zero
        row_sum = probs.sum(dim=-1, keepdim=True)
        lses.append((row_max + row_sum.log()).squeeze(-1))  # -inf where nothing is visible
        probs.div_(row_sum.clamp(min=torch.finfo(torch.float32).tiny))
        outs.append(torch.einsum("krnm,kmd->krnd", probs, v))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_backward(dout_KRND: torch.Tensor, q_KRND: torch.Tensor, k_KMD: torch.Tensor, v_KMD: torch.Tensor,
                    lse_KRN: torch.Tensor, delta_KRN: torch.Tensor, visible_NM: torch.Tensor,
                    scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient contributions of one block, given the FINAL (all-block) lse and delta = rowsum(dO * O)."""
    k, v = k_KMD.float(), v_KMD.float()
    dk_KMD, dv_KMD = torch.zeros_like(k), torch.zeros_like(v)
    dqs = []
    for r0 in range(0, q_KRND.shape[2], ROWS_PER_TILE):
        rows = slice(r0, r0 + ROWS_PER_TILE)
        q, dout = q_KRND[:, :, rows].float(), dout_KRND[:, :, rows]
        scores, tanh = _scores(q, k, scale, softcap)
        probs = scores.sub_(lse_KRN[:, :, rows, None]).exp_()
        probs.masked_fill_(~visible_NM[rows], 0.0)
        dv_KMD += torch.einsum("krnm,krnd->kmd", probs, dout)
        dscores = torch.einsum("krnd,kmd->krnm", dout, v).sub_(delta_KRN[:, :, rows, None]).mul_(probs)
        del probs
        if tanh is not None:  # d(softcap * tanh(s / softcap)) / ds = 1 - tanh^2
            dscores.mul_(1 - tanh.square_())
        dqs.append(torch.einsum("krnm,kmd->krnd", dscores, k).mul_(scale))
        dk_KMD += torch.einsum("krnm,krnd->kmd", dscores, q).mul_(scale)
    return torch.cat(dqs, dim=2), dk_KMD, dv_KMD


class _EinsumBlocks:
    """Plain-PyTorch blocks, fp32 (any device and dtype)."""

    name = "fp32 einsum blocks"

    def __init__(self, softcap: float | None = None):
        self.softcap = softcap

    def forward(self, layout: _RingLayout, src: int, rows, cols, q_KRND, k_KMD, v_KMD, scale):
        return _block_forward(q_KRND, k_KMD, v_KMD, layout.visible(src, rows, cols), scale, self.softcap)

    def backward(self, layout: _RingLayout, src: int, rows, cols, dout_KRND, q_KRND, k_KMD, v_KMD, out_KRND,
                 lse_KRN, delta_KRN, scale):
        return _block_backward(dout_KRND, q_KRND, k_KMD, v_KMD, lse_KRN, delta_KRN, layout.visible(src, rows, cols),
                               scale, self.softcap)


class _FlashBlocks:
    """PyTorch's FlashAttention-2 varlen kernel per block (`flash_ops`); inputs in their fp16/bf16 dtype,
    results handed back in fp32 for the merge and the dK/dV accumulators."""

    name = "flash blocks (torch's FlashAttention-2 varlen kernel)"

    def __init__(self):
        self.rng = None

    def forward(self, layout: _RingLayout, src: int, rows, cols, q_KRND, k_KMD, v_KMD, scale):
        K, R, n, D = q_KRND.shape
        cu_q, cu_k, max_q, max_k, causal = layout.varlen(src)
        out, lse, self.rng = flash_ops.flash_varlen_forward(
            _to_NHD(q_KRND), k_KMD.transpose(0, 1).contiguous(), v_KMD.transpose(0, 1).contiguous(),
            cu_q, cu_k, max_q, max_k, causal, scale)
        return _to_KRND(out, K).float(), lse.float().reshape(K, R, n)

    def backward(self, layout: _RingLayout, src: int, rows, cols, dout_KRND, q_KRND, k_KMD, v_KMD, out_KRND,
                 lse_KRN, delta_KRN, scale):
        K, R, n, D = q_KRND.shape
        cu_q, cu_k, max_q, max_k, causal = layout.varlen(src)
        rng = self.rng if self.rng is not None else (torch.empty(0), torch.empty(0))
        dq, dk, dv = flash_ops.flash_varlen_backward(
            _to_NHD(dout_KRND.to(q_KRND.dtype)), _to_NHD(q_KRND), k_KMD.transpose(0, 1).contiguous(),
            v_KMD.transpose(0, 1).contiguous(), _to_NHD(out_KRND.to(q_KRND.dtype)), lse_KRN.reshape(K * R, n),
            cu_q, cu_k, max_q, max_k, causal, scale, rng)
        return _to_KRND(dq, K).float(), dk.transpose(0, 1).float(), dv.transpose(0, 1).float()


BLOCK_KERNELS = ("auto", "flash", "einsum")


def block_kernel_for(q: torch.Tensor, block_kernel: str = "auto", window: int | None = None,
                     softcap: float | None = None) -> _EinsumBlocks | _FlashBlocks:
    """The block kernel ring attention runs for tensors like q ("auto": flash where `flash_ops` supports q and
    neither a sliding window nor a soft-cap is set)."""
    if block_kernel not in BLOCK_KERNELS:
        raise ValueError(f"unknown ring block kernel {block_kernel!r}; choose one of {BLOCK_KERNELS}")
    variants = window is not None or softcap is not None
    supported = flash_ops.flash_varlen_supported(q) and not variants
    if block_kernel == "flash" and not supported:
        raise ValueError("block_kernel='flash' needs fp16/bf16 CUDA tensors on an Ampere or newer GPU, head dim a "
                         "multiple of 8 up to 256, and no sliding window or soft-cap")
    if block_kernel == "flash" or (block_kernel == "auto" and supported):
        return _FlashBlocks()
    return _EinsumBlocks(softcap)


def describe_block_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, variants: bool = False) -> str:
    """The block kernel's name for a model's device, dtype and head dim (for the start-up layout line);
    variants: the model has a sliding window or soft-cap on some layer (those layers run einsum blocks)."""
    if device.type == "cuda" and torch.cuda.is_available():
        probe = torch.empty(1, 1, head_dim, device=device, dtype=dtype)
    else:
        probe = torch.empty(1, 1, head_dim, dtype=dtype)
    name = block_kernel_for(probe).name
    if variants and name != _EinsumBlocks.name:
        return f"{name}; {_EinsumBlocks.name} on sliding-window or soft-capped layers"
    return name


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _merge_into(out_KRND: torch.Tensor, lse_KRN: torch.Tensor, rows: slice | torch.Tensor,
                block_out_KRND: torch.Tensor, block_lse_KRN: torch.Tensor) -> None:
    """Online-softmax merge of a block's (output, lse) into the running one, in place on `rows`."""
    old_lse = lse_KRN[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse_KRN)
    safe = _finite(new_lse)
    merged = (out_KRND[:, :, rows] * torch.exp(old_lse - safe)[..., None]
              + block_out_KRND * torch.exp(block_lse_KRN - safe)[..., None])
    out_KRND[:, :, rows] = merged
    lse_KRN[:, :, rows] = new_lse


# ---- communication -------------------------------------------------------------------------------


def _start_ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup | None, tag: int = 0) -> tuple[torch.Tensor, list]:
    """Send `tensor` to the next rank of the ring and receive the previous rank's; returns (buffer, works).

    Every rank of `group` must call it in the same step. Distinct tags keep the K/V and dK/dV messages
    (same shape) from being matched to each other on backends that honour tags (gloo)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    buffer = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), nxt, group, tag),
           dist.P2POp(dist.irecv, buffer, prv, group, tag)]
    return buffer, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


# ---- ring passes ---------------------------------------------------------------------------------


def _ring_forward(q_KRND: torch.Tensor, kv_2KND: torch.Tensor, layout: _RingLayout, group: dist.ProcessGroup | None,
                  scale: float, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (fp32) and lse of local queries against every rank's K/V, one block per ring step."""
    K, R, N, D = q_KRND.shape
    out_KRND = torch.zeros(K, R, N, D, dtype=torch.float32, device=q_KRND.device)
    lse_KRN = torch.full((K, R, N), float("-inf"), dtype=torch.float32, device=q_KRND.device)
    current = kv_2KND
    for step in range(layout.ring_size):
        if step + 1 < layout.ring_size:  # overlap: the next block travels while this one is computed
            incoming, works = _start_ring_shift(current, group)
        src = (layout.rank - step) % layout.ring_size
        rows, cols = layout.block(src)
        block_out, block_lse = kernel.forward(layout, src, rows, cols, q_KRND[:, :, rows], current[0][:, cols],
                                              current[1][:, cols], scale)
        _merge_into(out_KRND, lse_KRN, rows, block_out, block_lse)
        if step + 1 < layout.ring_size:
            _wait(works)
            current = incoming
    return out_KRND, lse_KRN


def _ring_backward(dout_KRND: torch.Tensor, q_KRND: torch.Tensor, kv_2KND: torch.Tensor, out_KRND: torch.Tensor,
                   lse_KRN: torch.Tensor, layout: _RingLayout, group: dist.ProcessGroup | None,
                   scale: float, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [K, R, N, D], dkv [2, K, N, D]) in fp32. The dK/dV accumulator of a block travels with it and
    makes one extra hop at the end, which brings every rank's own accumulator home."""
    dout_KRND = dout_KRND.float()
    delta_KRN = (dout_KRND * out_KRND.float()).sum(-1)
    dq_KRND = torch.zeros(q_KRND.shape, dtype=torch.float32, device=q_KRND.device)
    dkv_2KND = torch.zeros(kv_2KND.shape, dtype=torch.float32, device=q_KRND.device)
    current = kv_2KND
    for step in range(layout.ring_size):
        last = step + 1 == layout.ring_size
        if not last:
            incoming, kv_works = _start_ring_shift(current, group)
        src = (layout.rank - step) % layout.ring_size
        rows, cols = layout.block(src)
        dq, dk, dv = kernel.backward(layout, src, rows, cols, dout_KRND[:, :, rows], q_KRND[:, :, rows],
                                     current[0][:, cols], current[1][:, cols], out_KRND[:, :, rows],
                                     lse_KRN[:, :, rows], delta_KRN[:, :, rows], scale)
        dq_KRND[:, :, rows] += dq
        dkv_2KND[0][:, cols] += dk
        dkv_2KND[1][:, cols] += dv
        if layout.ring_size > 1:
            dkv_2KND, dkv_works = _start_ring_shift(dkv_2KND, group, tag=1)
            _wait(dkv_works)
        if not last:
            _wait(kv_works)
            current = incoming
    return dq_KRND, dkv_2KND


def _head_groups(num_kv_heads: int, head_stride: int | None) -> list[slice]:
    stride = num_kv_heads if head_stride is None else head_stride
    if stride <= 0 or num_kv_heads % stride:
        raise ValueError(f"ring_head_stride={head_stride} must be a positive divisor of the {num_kv_heads} kv heads")
    return [slice(k0, k0 + stride) for k0 in range(0, num_kv_heads, stride)]


def _to_KRND(x_NHD: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    N, H, D = x_NHD.shape
    return x_NHD.reshape(N, num_kv_heads, H // num_kv_heads, D).permute(1, 2, 0, 3)


def _to_NHD(x_KRND: torch.Tensor) -> torch.Tensor:
    K, R, N, D = x_KRND.shape
    return x_KRND.permute(2, 0, 1, 3).reshape(N, K * R, D)


class _RingAttention(torch.autograd.Function):
    """Saves only q, k, v, the output and the lse (float32 [K, R, N]) for the backward."""

    @staticmethod
    def forward(ctx, q_NHD, k_NKD, v_NKD, layout, group, scale, head_stride, kernel):
        K = k_NKD.shape[1]
        q_KRND = _to_KRND(q_NHD, K)
        kv_2KND = torch.stack([k_NKD, v_NKD]).transpose(1, 2)
        outs, lses = [], []
        for heads in _head_groups(K, head_stride):
            out, lse = _ring_forward(q_KRND[heads], kv_2KND[:, heads].contiguous(), layout, group, scale, kernel)
            outs.append(out)
            lses.append(lse)
        out_NHD = _to_NHD(torch.cat(outs)).to(q_NHD.dtype)
        ctx.save_for_backward(q_NHD, k_NKD, v_NKD, out_NHD, torch.cat(lses))
        ctx.layout, ctx.group, ctx.scale, ctx.head_stride, ctx.kernel = layout, group, scale, head_stride, kernel
        return out_NHD

    @staticmethod
    def backward(ctx, dout_NHD):
        q_NHD, k_NKD, v_NKD, out_NHD, lse_KRN = ctx.saved_tensors
        K = k_NKD.shape[1]
        q_KRND, out_KRND, dout_KRND = (_to_KRND(t, K) for t in (q_NHD, out_NHD, dout_NHD))
        kv_2KND = torch.stack([k_NKD, v_NKD]).transpose(1, 2)
        dqs, dkvs = [], []
        for heads in _head_groups(K, ctx.head_stride):
            dq, dkv = _ring_backward(dout_KRND[heads], q_KRND[heads], kv_2KND[:, heads].contiguous(), out_KRND[heads],
                                     lse_KRN[heads], ctx.layout, ctx.group, ctx.scale, ctx.kernel)
            dqs.append(dq)
            dkvs.append(dkv)
        dq_NHD = _to_NHD(torch.cat(dqs)).to(q_NHD.dtype)
        dkv_2NKD = torch.cat(dkvs, dim=1).transpose(1, 2).to(k_NKD.dtype)
        return dq_NHD, dkv_2NKD[0], dkv_2NKD[1], None, None, None, None, None


def ring_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor,
                   group: dist.ProcessGroup | None, causal: bool = True, scale: float | None = None,
                   head_stride: int | None = None, layout_cache: dict | None = None,
                   block_kernel: str = "auto", window: int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """Attention of this rank's zigzag shard against the whole packed row; returns the local [N, H, D].

    q/k/v: this rank's shard (`zigzag_shard` of the global packed tensors). cu_seqlens: the GLOBAL
    int32 [S + 1] boundaries, every segment a multiple of 2W. group: the sequence-parallel group (None =
    the world group); every rank of it must call this with the same cu_seqlens, in the same order.
    head_stride: kv heads per ring pass (None = all at once). layout_cache: a dict kept for the duration
    of one model forward (all its layers share the same boundaries): the zigzag block plan is built once
    and reused from it. block_kernel: "auto" (flash blocks on fp16/bf16 CUDA, else fp32 einsum blocks),
    "flash" or "einsum" (`block_kernel_for`). window / softcap: sliding-window attention and logit
    soft-capping (module docstring; einsum blocks). Differentiable in q, k, v.
    """
    check_attention_variants(window, softcap, causal)
    if group is None and dist.is_initialized():
        group = dist.group.WORLD  # get_global_rank(None, r) raises: name the default group explicitly
    ring_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    check_zigzag_lengths(cu_seqlens, ring_size)
    N, H, D = q_NHD.shape
    if N * ring_size != int(cu_seqlens[-1]) or k_NKD.shape[0] != N or k_NKD.shape != v_NKD.shape:
        raise ValueError(f"local q/k/v must hold {int(cu_seqlens[-1])} / {ring_size} tokens, got {tuple(q_NHD.shape)}, "
                         f"{tuple(k_NKD.shape)}, {tuple(v_NKD.shape)}")
    if H % k_NKD.shape[1]:
        raise ValueError(f"{H} query heads are not a multiple of {k_NKD.shape[1]} kv heads")
    key = (causal, str(q_NHD.device), rank, ring_size, window)
    layout = layout_cache.get(key) if layout_cache is not None else None
    if layout is None:
        layout = _RingLayout.build(cu_seqlens, rank, ring_size, causal, q_NHD.device, window)
        if layout_cache is not None:
            layout_cache[key] = layout
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kernel = block_kernel_for(q_NHD, block_kernel, window, softcap)
    return _RingAttention.apply(q_NHD, k_NKD, v_NKD, layout, group, scale, head_stride, kernel)
