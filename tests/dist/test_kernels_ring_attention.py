"""Ring attention over 2 and 4 gloo ranks equals unsharded varlen attention: outputs and dq, dk, dv, for several
sequence-length mixes, GQA and head strides; and a tiny Llama with `rlhf_ring` attention gives the unsharded
model's log-probs and gradients.

Shape legend: G global packed tokens, N local tokens, H/K query/kv heads, D head dim."""

import torch
from rlhf.kernels import (
    next_token_targets,
    pack_sequences,
    ring_attention,
    token_logprobs,
    zigzag_shard,
    zigzag_unshard,
)

from rlhf.models.zoo import FAMILIES
from tests.distributed import run_on_ranks
from tests.ring_cases import CASES, case_inputs, check_against_reference


def _ring_worker(ring_sizes: list[int]) -> dict:
    """On every rank, for each ring size: split the world into rings of that size (explicit subgroups) and
    run all CASES; returns {ring size: [local (out, dq, dk, dv) per case]}."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for ring_size in ring_sizes:
        rings = [list(range(r0, r0 + ring_size)) for r0 in range(0, world, ring_size)]
        groups = [dist.new_group(ranks) for ranks in rings]  # every rank creates every group, same order
        results[ring_size] = _run_cases(groups[rank // ring_size], ring_size)
    return results


def _run_cases(group, ring_size_of_group: int) -> list:
    import torch.distributed as dist

    ring_rank = dist.get_rank(group)
    results = []
    for i, (lengths, num_heads, num_kv_heads, head_stride) in enumerate(CASES):
        q, k, v, w, cu, _ = case_inputs(lengths, ring_size_of_group, num_heads, num_kv_heads, seed=i)
        q, k, v, w = (zigzag_shard(t, cu, ring_rank, ring_size_of_group) for t in (q, k, v, w))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = ring_attention(q, k, v, cu, group, causal=True, head_stride=head_stride)
        (out * w).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    return results


def test_ring_attention_two_ranks():
    results = run_on_ranks(2, _ring_worker, [2])
    check_against_reference([r[2] for r in results], ring_size=2)


def test_ring_attention_four_ranks_and_two_rings_of_two():
    results = run_on_ranks(4, _ring_worker, [4, 2])
    check_against_reference([r[4] for r in results], ring_size=4)
    check_against_reference([r[2] for r in results[:2]], ring_size=2)  # ring of ranks 0, 1
    check_against_reference([r[2] for r in results[2:]], ring_size=2)  # ring of ranks 2, 3


LLAMA_LENGTHS = [5, 11, 16]


def _llama_inputs(ring_size):
    """Packed sequences (segments padded to 2W), next-token targets and loss weights on real targets."""
    g = torch.Generator().manual_seed(11)
    packed = pack_sequences([torch.randint(1, 64, (n,), generator=g) for n in LLAMA_LENGTHS],
                            pad_to_multiple_of=2 * ring_size)
    targets_1N = next_token_targets(packed)
    weights_1N = torch.zeros(1, packed.num_tokens)
    for start, n in zip(packed.cu_seqlens[:-1].tolist(), packed.seqlens):
        weights_1N[0, start:start + n - 1] = torch.randn(n - 1, generator=g)
    return packed, targets_1N, weights_1N


def _model(attn_implementation: str, model_path: str | None):
    """The random tiny Llama, or a model of the zoo (`model_path`), with the given attention."""
    from rlhf.models.loading import load_causal_lm
    from tests.tiny_actor import tiny_llama

    return tiny_llama(attn_implementation) if model_path is None else load_causal_lm(model_path, torch.float32,
                                                                                     attn_implementation)


def _ring_model_pass(model, head_stride, group):
    """This rank's shard log-probs and the all-reduced parameter gradients of sum(w * logprobs)."""
    import torch.distributed as dist

    from rlhf.models.attention import ring_forward_kwargs

    ring_size, rank = dist.get_world_size(group), dist.get_rank(group)
    packed, targets_1N, weights_1N = _llama_inputs(ring_size)
    logits_1NV = model(**ring_forward_kwargs(packed, group, head_stride=head_stride)).logits
    shard = [zigzag_shard(t, packed.cu_seqlens, rank, ring_size, dim=1) for t in (targets_1N, weights_1N)]
    logprobs_1N = token_logprobs(logits_1NV, shard[0])
    (logprobs_1N * shard[1]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)  # tokens of one sequence live on every rank: sum their grads
            grads[name] = p.grad
    return logprobs_1N.detach(), grads


def _ring_llama_worker(head_stride, model_paths):
    """Each rank, for each model (None: the random tiny Llama; else a zoo directory): its ring pass."""
    import torch.distributed as dist

    from rlhf.models.attention import register_ring_attention

    return [_ring_model_pass(_model(register_ring_attention(), path), head_stride, dist.group.WORLD)
            for path in model_paths]


# One launch for every model (4 ranks would import transformers 4 times: slow). The zoo's families bring sliding
# windows of 8 tokens (Mistral, Gemma-2/3: the 11- and 16-token sequences reach past them), attention soft-capping
# (Gemma-2, on the einsum blocks), q/k norms, biases, fused projections and experts.
RING_FAMILIES = [None, *FAMILIES]  # None: the random tiny Llama


def test_ring_llama_equals_unsharded_varlen_llama(tmp_path):
    from rlhf.models.attention import register_varlen_attention
    from rlhf.models.zoo import build_family

    ring_size, head_stride = 2, 1
    paths = [build_family(f, str(tmp_path / f)) if f else None for f in RING_FAMILIES]
    per_rank = run_on_ranks(ring_size, _ring_llama_worker, head_stride, paths)
    packed, targets_1N, weights_1N = _llama_inputs(ring_size)
    real_1N = weights_1N != 0
    for i, (family_name, path) in enumerate(zip(RING_FAMILIES, paths)):
        model = _model(register_varlen_attention(), path)
        logprobs_1N = token_logprobs(model(**packed.forward_kwargs()).logits, targets_1N)
        (logprobs_1N * weights_1N).sum().backward()
        results = [rank_results[i] for rank_results in per_rank]
        got_1N = zigzag_unshard([lp for lp, _ in results], packed.cu_seqlens, dim=1)
        torch.testing.assert_close(got_1N[real_1N], logprobs_1N.detach()[real_1N], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, f=family_name: f"{f or 'tiny llama'}: {m}")
        grads_checked = 0
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            grads_checked += 1
            for _, grads in results:
                torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4,
                                           msg=lambda m, n=name, f=family_name: f"{f or 'tiny llama'} {n}: {m}")
        assert grads_checked > 10, family_name
