"""Packing round trips, varlen attention == block-diagonal reference, and the must-show equivalence: a tiny Llama on
a packed row (rlhf_varlen attention) gives the padded batch's log-probs and gradients.

Shape legend: B batch, T padded positions, N packed tokens, H/K query/kv heads, D head dim, V vocab."""

import pytest
import torch
from rlhf.kernels import (
    cu_seqlens_from_lengths,
    max_seqlen_from_cu,
    next_token_targets,
    pack_padded,
    pack_sequences,
    token_logprobs,
    unpack_to_list,
    unpack_to_padded,
    varlen_attention,
    varlen_attention_reference,
    varlen_attention_sdpa,
)

from tests.tiny_actor import tiny_llama


def _right_padded(lengths, T, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids_BT = torch.randint(1, vocab, (len(lengths), T), generator=g)
    mask_BT = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return ids_BT * mask_BT, mask_BT


def test_pack_padded_boundaries_and_positions():
    ids_BT, mask_BT = _right_padded([3, 1, 5], T=6)
    packed = pack_padded(ids_BT, mask_BT)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 9]
    assert packed.position_ids_1N.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4]]
    assert packed.input_ids_1N[0].tolist() == ids_BT[0, :3].tolist() + ids_BT[1, :1].tolist() + ids_BT[2].tolist()[:5]
    assert packed.max_seqlen == 5 == max_seqlen_from_cu(packed.cu_seqlens)
    assert packed.seqlens == (3, 1, 5)


def test_pack_pads_segments_to_multiple():
    packed = pack_sequences([torch.arange(1, 6), torch.arange(1, 4)], pad_to_multiple_of=4, pad_token_id=0)
    assert packed.cu_seqlens.tolist() == [0, 8, 12]
    assert packed.input_ids_1N[0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3, 0]
    assert packed.position_ids_1N[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert packed.seqlens == (5, 3) and packed.max_seqlen == 8


def test_unpack_round_trip_and_gradient():
    ids_BT, mask_BT = _right_padded([4, 2, 6], T=7, seed=1)
    packed = pack_padded(ids_BT, mask_BT, pad_to_multiple_of=4)
    values_N = torch.randn(packed.num_tokens, requires_grad=True)
    padded_BT = unpack_to_padded(values_N[None], packed, padded_len=7, pad_value=-1.0)
    assert padded_BT.shape == (3, 7)
    for row, seq, n in zip(padded_BT, unpack_to_list(values_N, packed), packed.seqlens):
        torch.testing.assert_close(row[:n], seq)
        assert (row[n:] == -1).all()
    padded_BT.sum().backward()
    real_N = torch.zeros(packed.num_tokens)
    for start, n in zip(packed.cu_seqlens[:-1].tolist(), packed.seqlens):
        real_N[start:start + n] = 1
    torch.testing.assert_close(values_N.grad, real_N)


def test_pack_rejects_left_padding():
    ids_BT, mask_BT = _right_padded([2, 3], T=4)
    with pytest.raises(ValueError, match="right-padded"):
        pack_padded(ids_BT, mask_BT.flip(-1))


def test_next_token_targets_stay_inside_segments():
    packed = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    assert next_token_targets(packed, fill_token_id=-1).tolist() == [[6, 7, -1, 9, -1]]


@pytest.mark.parametrize("lengths", [[7], [3, 9, 1, 5]])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_matches_reference(lengths, num_kv_heads, causal):
    g = torch.Generator().manual_seed(len(lengths) * 10 + num_kv_heads)
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    N = sum(lengths)
    q = torch.randn(N, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(N, num_kv_heads, 8, generator=g, requires_grad=True)
    v = torch.randn(N, num_kv_heads, 8, generator=g, requires_grad=True)
    w = torch.randn(N, 4, 8, generator=g)
    out = varlen_attention(q, k, v, cu_seqlens, max(lengths), causal=causal, scale=0.3)
    ref = varlen_attention_reference(q, k, v, cu_seqlens, causal=causal, scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_varlen_sdpa_runs_the_fused_cpu_kernel_per_segment():
    """On CPU each segment goes through PyTorch's fused flash kernel (4-D inputs; 3-D ones took the unfused math
    path), forward and backward, and the segments' gradients are joined by one cat: no per-segment slice
    backward (each of which filled a zero tensor of all N tokens)."""
    from torch.profiler import profile

    lengths = [3, 9, 1, 5]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 4, 8, generator=g, requires_grad=True)
    kv = torch.randn(sum(lengths), 2, 8, generator=g, requires_grad=True)
    with profile() as prof:
        out = varlen_attention_sdpa(q, kv, kv, cu_seqlens_from_lengths(lengths))
        torch.autograd.grad(out.sum(), (q, kv))
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("aten::_scaled_dot_product_flash_attention_for_cpu") == len(lengths)
    assert calls.get("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == len(lengths)
    assert "aten::_scaled_dot_product_attention_math" not in calls
    assert "aten::slice_backward" not in calls


def test_varlen_rejects_bad_boundaries():
    q = torch.randn(6, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention_sdpa(q, q, q, cu_seqlens_from_lengths([2, 3]))


# ---- packed == padded on a tiny Llama ------------------------------------------------------------

def _padded_logprobs(model, ids_BT, mask_BT):
    position_ids_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids_BT,
                       use_cache=False).logits
    return token_logprobs(logits_BTV[:, :-1], ids_BT[:, 1:])


def _packed_logprobs(model, packed, T):
    logits_1NV = model(**packed.forward_kwargs()).logits
    logprobs_1N = token_logprobs(logits_1NV, next_token_targets(packed))
    return unpack_to_padded(logprobs_1N, packed, padded_len=T)[:, :-1]


@pytest.mark.parametrize("pad_to_multiple_of", [1, 8])
def test_packed_llama_equals_padded(pad_to_multiple_of):
    from rlhf.models.attention import register_varlen_attention

    name = register_varlen_attention()
    ids_BT, mask_BT = _right_padded([5, 12, 3, 9], T=12, vocab=64, seed=3)
    valid_BT = mask_BT[:, 1:].bool()
    padded_model, packed_model = tiny_llama("sdpa"), tiny_llama(name)
    packed_model.load_state_dict(padded_model.state_dict())

    lp_padded = _padded_logprobs(padded_model, ids_BT, mask_BT)
    packed = pack_padded(ids_BT, mask_BT, pad_to_multiple_of=pad_to_multiple_of)
    lp_packed = _packed_logprobs(packed_model, packed, T=12)
    torch.testing.assert_close(lp_packed[valid_BT], lp_padded[valid_BT], atol=1e-5, rtol=1e-5)

    weights_BT = torch.randn(lp_padded.shape, generator=torch.Generator().manual_seed(4)) * valid_BT
    (lp_padded * weights_BT).sum().backward()
    (lp_packed * weights_BT).sum().backward()
    for (name_p, p_padded), p_packed in zip(padded_model.named_parameters(), packed_model.parameters()):
        torch.testing.assert_close(p_packed.grad, p_padded.grad, atol=1e-5, rtol=1e-4, msg=name_p)


def test_varlen_model_requires_explicit_boundaries():
    from rlhf.models.attention import register_varlen_attention

    model = tiny_llama(register_varlen_attention())
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.tensor([[0, 1, 0]]), use_cache=False)


def test_varlen_backend_choice_on_cpu():
    from rlhf.kernels.varlen_attention import varlen_backend_for

    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert varlen_backend_for(q) == "sdpa"  # CPU: neither flash kernel applies
    for backend in ("flash", "torch_flash"):
        with pytest.raises(ValueError, match="CUDA"):
            varlen_backend_for(q, backend)
    with pytest.raises(ValueError, match="unknown varlen attention backend"):
        varlen_backend_for(q, "xformers")


@pytest.mark.parametrize("window,softcap", [(3, None), (None, 0.7), (3, 0.7)])
def test_varlen_sliding_window_and_softcap_match_reference(window, softcap):
    """The SDPA loop with a sliding window (Mistral, Gemma) and a logit soft-cap (Gemma-2) equals the naive
    reference in output and gradients, and both differ from plain attention; a window of 1 returns v itself."""
    lengths = [3, 9, 1, 5]
    g = torch.Generator().manual_seed(5)
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    q = torch.randn(18, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(18, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(18, 2, 8, generator=g, requires_grad=True)
    w = torch.randn(18, 4, 8, generator=g)
    out = varlen_attention(q, k, v, cu_seqlens, 9, window=window, softcap=softcap)
    ref = varlen_attention_reference(q, k, v, cu_seqlens, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert float((varlen_attention_reference(q, k, v, cu_seqlens) - ref).detach().abs().max()) > 0.05
    for got, want in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                         torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    only_self = varlen_attention(q, k, v, cu_seqlens, 9, window=1, softcap=softcap)
    torch.testing.assert_close(only_self, v.repeat_interleave(2, dim=1), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="sliding window 0"):
        varlen_attention(q, k, v, cu_seqlens, 9, window=0)
