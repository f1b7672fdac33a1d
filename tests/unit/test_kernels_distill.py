"""The chunked knowledge-distillation loss equals the float32 reference in value and student gradient, and
both equal a hand-computed example; the teacher gets no gradient; the chunked backward keeps no [N, V]
float32 tensor."""

import math

import pytest
import torch
from rlhf.kernels import kd_loss_chunked, kd_loss_reference

LN2 = math.log(2.0)


def _inputs(dtype, seed=0, B=2, T=7, V=53):
    g = torch.Generator().manual_seed(seed)
    student = 3 * torch.randn(B, T, V, generator=g)
    teacher = 3 * torch.randn(B, T, V, generator=g)
    student[0, 2, 5] = -math.inf  # a masked-vocabulary entry where the teacher has mass
    teacher[1, 3, 9] = -math.inf
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1, 4] = False  # a masked-out row, whatever the draw
    mask[0, 2] = True
    return student.to(dtype), teacher.to(dtype), mask


def _value_and_grad(fn, student, teacher, mask, **kwargs):
    student = student.clone().requires_grad_()
    loss = fn(student, teacher, mask, **kwargs)
    loss.backward()
    return loss, student.grad


@pytest.mark.parametrize("chunk", [1, 4, 14, 1024])  # 14 rows: 4 does not divide them, 14 does
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_reference_value_and_grad(chunk, dtype):
    student, teacher, mask = _inputs(dtype, seed=chunk)
    ref_loss, ref_grad = _value_and_grad(kd_loss_reference, student, teacher, mask)
    loss, grad = _value_and_grad(kd_loss_chunked, student, teacher, mask, chunk_tokens=chunk)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.isfinite(loss) and ref_grad.abs().sum() > 0
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-3}[dtype]
    torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)
    assert grad[1, 4].abs().max() == 0  # the masked-out row
    assert grad[0, 2, 5] == 0  # the -inf student logit


def test_hand_computed_two_tokens_three_vocab():
    # token 0: student uniform (log p = -ln 3), teacher softmax(0, ln 2, 0) = (1/4, 1/2, 1/4) -> CE ln 3
    # token 1: student softmax(ln 2, 0, -inf) = (2/3, 1/3, 0), teacher uniform; the -inf term is dropped
    #          -> CE = -(1/3 ln(2/3) + 1/3 ln(1/3)) = ln(9/2) / 3
    # token 2: masked out
    student = torch.tensor([[[0.0, 0.0, 0.0], [LN2, 0.0, -math.inf], [5.0, -2.0, 1.0]]])
    teacher = torch.tensor([[[0.0, LN2, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]]])
    mask = torch.tensor([[True, True, False]])
    expected_loss = torch.tensor((math.log(3) + math.log(4.5) / 3) / 2)
    # d CE / d s = p * Q - q with Q the teacher mass on finite student logits, then / 2 tokens:
    # token 0: (1/3 - 1/4, 1/3 - 1/2, 1/3 - 1/4) / 2; token 1 (Q = 2/3): (4/9 - 1/3, 2/9 - 1/3, 0) / 2
    expected_grad = torch.tensor([[[1 / 24, -1 / 12, 1 / 24], [1 / 18, -1 / 18, 0.0], [0.0, 0.0, 0.0]]])
    for fn, kwargs in [(kd_loss_reference, {}), (kd_loss_chunked, {"chunk_tokens": 2})]:
        loss, grad = _value_and_grad(fn, student, teacher, mask, **kwargs)
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("fn", [kd_loss_reference, kd_loss_chunked])
def test_teacher_gets_no_gradient(fn):
    student, teacher, mask = _inputs(torch.float32)
    student.requires_grad_()
    teacher.requires_grad_()
    fn(student, teacher, mask).backward()
    assert teacher.grad is None and student.grad is not None


def test_micro_batches_with_global_count_sum_to_whole_batch():
    student, teacher, mask = _inputs(torch.float32, B=4, T=5)
    whole_loss, whole_grad = _value_and_grad(kd_loss_reference, student, teacher, mask)
    student = student.clone().requires_grad_()
    num_tokens = mask.sum()
    pieces = sum(kd_loss_chunked(student[i:i + 2], teacher[i:i + 2], mask[i:i + 2], chunk_tokens=3,
                                 num_tokens=num_tokens) for i in (0, 2))
    pieces.backward()
    torch.testing.assert_close(pieces, whole_loss)
    torch.testing.assert_close(student.grad, whole_grad)


def test_chunked_saves_only_inputs_and_per_row_floats():
    student, teacher, mask = _inputs(torch.bfloat16, B=2, T=8, V=64)
    student.requires_grad_()
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kd_loss_chunked(student, teacher, mask, chunk_tokens=4)
    assert saved, "nothing saved: the hook did not run"
    for dtype, shape in saved:  # any [N, V] tensor saved must be an input, in its own (bf16) dtype
        assert not (len(shape) >= 2 and shape[-1] == 64 and dtype == torch.float32), saved


def test_mismatched_vocabularies_are_a_value_error():
    with pytest.raises(ValueError, match="same tokenizer"):
        kd_loss_chunked(torch.zeros(1, 2, 5), torch.zeros(1, 2, 6), torch.ones(1, 2, dtype=torch.bool))


def test_all_masked_batch_gives_zero_not_nan():
    student, teacher, _ = _inputs(torch.float32)
    mask = torch.zeros(student.shape[:-1], dtype=torch.bool)
    for fn in (kd_loss_reference, kd_loss_chunked):
        loss, grad = _value_and_grad(fn, student, teacher, mask)
        assert loss == 0 and grad.abs().max() == 0
