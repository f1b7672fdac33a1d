"""Knowledge-distillation loss over the full vocabulary (OpenRLHF `KDLoss`), in plain PyTorch.

The loss is the cross-entropy of the student's next-token distribution against the teacher's,
-sum_v p_teacher(v) log p_student(v) (the forward KL up to the teacher's entropy, which has no student
gradient), averaged over the masked token positions. Vocabulary entries where the student logit is
+-inf are left out of the sum, as OpenRLHF does, so a -inf (masked-vocabulary) student logit adds 0
instead of NaN. The teacher gets no gradient.

`kd_loss_reference` materialises the float32 softmax and log-softmax of both models. `kd_loss_chunked`
runs `chunk_tokens` rows at a time in the forward and recomputes them chunk by chunk in the backward, so
it saves only the logits and four numbers per row for the backward, and its float32 temporaries are two
[chunk_tokens, V] workspaces (plus, on CPU, one cast copy of a chunk). A +inf or NaN logit makes its row's
loss non-finite in both, as in OpenRLHF.
Shapes: B batch, T positions, V vocabulary, N flattened rows (B * T).
"""

from __future__ import annotations

import torch


def kd_loss_reference(student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, mask_BT: torch.Tensor,
                      num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """-sum_{masked t} sum_v q_t(v) log p_t(v) / num_tokens, a float32 scalar, with the full float32 [B, T, V].

    q = softmax(teacher), p = softmax(student); terms where the student logit is infinite are dropped.
    `mask_BT` (bool or 0/1) marks the positions whose logits are distilled. `num_tokens`: the masked-token
    count of the whole optimizer step over micro-batches and DP ranks (so the pieces sum to the global
    mean); default this call's `mask_BT.sum()`, at least 1.
    """
    _check_shapes(student_logits_BTV, teacher_logits_BTV, mask_BT)
    teacher_probs = teacher_logits_BTV.detach().float().softmax(-1)
    student_logprobs = student_logits_BTV.float().log_softmax(-1)
    terms = torch.where(torch.isinf(student_logits_BTV), 0.0, teacher_probs * student_logprobs)
    return _masked_token_mean(-terms.sum(-1), mask_BT, num_tokens)


def kd_loss_chunked(student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, mask_BT: torch.Tensor,
                    chunk_tokens: int = 1024, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Same value and student gradient as `kd_loss_reference`, `chunk_tokens` rows at a time in the forward
    and the backward: no float32 [B, T, V] tensor is alive at once (the gradient has the logits' dtype)."""
    _check_shapes(student_logits_BTV, teacher_logits_BTV, mask_BT)
    V = student_logits_BTV.shape[-1]
    if student_logits_BTV.numel() == 0:
        return student_logits_BTV.float().sum() * 0.0
    xent_N = _ChunkedKDCrossEntropy.apply(student_logits_BTV.reshape(-1, V),
                                          teacher_logits_BTV.detach().reshape(-1, V), chunk_tokens)
    return _masked_token_mean(xent_N, mask_BT.reshape(-1), num_tokens)


def _check_shapes(student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, mask_BT: torch.Tensor) -> None:
    if student_logits_BTV.shape != teacher_logits_BTV.shape:
        raise ValueError(f"student logits {tuple(student_logits_BTV.shape)} and teacher logits "
                         f"{tuple(teacher_logits_BTV.shape)} differ: distillation needs the same tokenizer and "
                         "vocabulary size (and the same token positions) for both models")
    assert mask_BT.shape == student_logits_BTV.shape[:-1], (mask_BT.shape, student_logits_BTV.shape)


def _masked_token_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor,
                       num_tokens: float | torch.Tensor | None) -> torch.Tensor:
    # `where`, not a product: a NaN row outside the mask must not reach the sum.
    total = torch.where(mask_BT.bool(), values_BT, 0.0).sum()
    return total / (mask_BT.sum().clamp(min=1) if num_tokens is None else num_tokens)


class _ChunkedKDCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy -sum_v q log p, float32 [N]. Saves the logits and, per row, the two
    logsumexps, the teacher mass Q on finite student logits and whether the row has an infinite one."""

    @staticmethod
    def forward(ctx, student_NV, teacher_NV, chunk_tokens):
        work = _workspaces(student_NV, chunk_tokens)
        rows_out = [_kd_chunk_forward(s, t, work[0, :len(s)], work[1, :len(s)])
                    for s, t in zip(student_NV.split(chunk_tokens), teacher_NV.split(chunk_tokens))]
        xent_N, *row_stats = (torch.cat(column) for column in zip(*rows_out))
        ctx.save_for_backward(student_NV, teacher_NV, *row_stats)
        ctx.chunk_tokens = chunk_tokens
        return xent_N

    @staticmethod
    def backward(ctx, dxent_N):
        student_NV, teacher_NV, *row_stats = ctx.saved_tensors
        dstudent_NV = torch.empty_like(student_NV)
        work = _workspaces(student_NV, ctx.chunk_tokens)
        for start in range(0, student_NV.shape[0], ctx.chunk_tokens):
            rows = slice(start, min(start + ctx.chunk_tokens, student_NV.shape[0]))
            num_rows = rows.stop - rows.start
            dstudent_NV[rows] = kd_cross_entropy_grad(
                student_NV[rows], teacher_NV[rows], *(stat[rows] for stat in row_stats), dxent_N[rows].float(),
                out=work[0, :num_rows], workspace=work[1, :num_rows])
        return dstudent_NV, None, None


def _workspaces(logits_NV: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    # Two float32 [chunk, V] buffers reused by every chunk: on CPU, fresh allocations of this size cost
    # page faults that take longer than the arithmetic done in them.
    return logits_NV.new_empty((2, min(chunk_tokens, logits_NV.shape[0]), logits_NV.shape[1]), dtype=torch.float32)


def _kd_chunk_forward(s_NV: torch.Tensor, t_NV: torch.Tensor, d: torch.Tensor,
                      q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(xent_N, student lse_N, teacher lse_N, teacher mass Q_N, has_inf_N) for one chunk, using the float32
    workspaces d and q ([N, V]).

    With d = s - max(s) and Z = sum exp(d): log p = d - log Z, so sum_v q log p = q.d - Q log Z, where the
    dot product and Q run over finite student logits only. Rows without an infinite student logit (q.d is
    finite) take the fast path; the rest are recomputed with the infinite entries masked out.
    """
    t_max = t_NV.amax(-1, keepdim=True).float()
    torch.sub(t_NV, t_max, out=q).exp_()
    t_sumexp = q.sum(-1)
    t_lse = t_max.view(-1) + t_sumexp.log()
    q.div_(t_sumexp[:, None])
    mass = q.sum(-1)
    s_max = s_NV.amax(-1, keepdim=True).float()
    torch.sub(s_NV, s_max, out=d)
    q_dot_d = q.mul_(d).sum(-1)  # q is spent; a cascade sum, as accurate as the reference's
    has_inf = ~torch.isfinite(q_dot_d)
    if has_inf.any():
        idx = has_inf.nonzero().view(-1)
        finite = ~torch.isinf(s_NV[idx])
        q_rows = torch.where(finite, (t_NV[idx].float() - t_lse[idx, None]).exp(), 0.0)
        mass[idx] = q_rows.sum(-1)
        q_dot_d[idx] = (q_rows * torch.where(finite, d[idx], 0.0)).sum(-1)
    log_z = d.exp_().sum(-1).log_()
    xent = -(q_dot_d - log_z * mass)
    return xent, s_max.view(-1) + log_z, t_lse, mass, has_inf


def kd_cross_entropy_grad(s_NV: torch.Tensor, t_NV: torch.Tensor, s_lse_N: torch.Tensor, t_lse_N: torch.Tensor,
                          teacher_mass_N: torch.Tensor, has_inf_N: torch.Tensor, dxent_N: torch.Tensor,
                          out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """d/ds of sum_n dxent_n * xent_n, float32 [N, V] (written into `out` if given), where
    xent_n = -sum_{v: s finite} q log p.

    d xent / d s_j = p_j * Q - q_j with Q = sum_{v: s_v finite} q_v (1 unless the student masks out
    teacher mass), and 0 where s_j is infinite (only rows flagged in `has_inf_N` have such entries).
    """
    grad = torch.sub(s_NV, s_lse_N[:, None], out=out).exp_()
    q = torch.sub(t_NV, t_lse_N[:, None], out=workspace).exp_()
    grad.mul_((teacher_mass_N * dxent_N)[:, None]).addcmul_(q, -dxent_N[:, None])
    if has_inf_N.any():
        idx = has_inf_N.nonzero().view(-1)
        grad[idx] = grad[idx].masked_fill(torch.isinf(s_NV[idx]), 0.0)
    return grad
