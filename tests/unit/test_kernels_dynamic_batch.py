"""Token-budget micro-batching: budgets hold, every sample is used once, every DP rank gets the same
number of micro-batches, and the split loss (sum over micro-batches / global token count) equals the
unsplit token-mean loss, gradients included.

Shape legend: N packed tokens, V vocabulary, E embedding width.
"""

import pytest
import torch
from rlhf.kernels import (
    balanced_micro_batches,
    count_micro_batches,
    dynamic_micro_batches,
    first_fit_decreasing,
    next_token_targets,
    pack_sequences,
    partition_across_ranks,
    split_into_micro_batches,
)

LENGTHS = [37, 5, 12, 60, 8, 8, 21, 3, 44, 17, 9, 30, 2]


def _flatten(nested):
    return sorted(i for mb in nested for i in mb)


def test_first_fit_decreasing_respects_budget_and_covers_all():
    bins = first_fit_decreasing(LENGTHS, 64)
    assert _flatten(bins) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 64 for b in bins)
    assert len(bins) == count_micro_batches(LENGTHS, 64) == 5  # 256 tokens, at least 4 bins; FFD needs 5


def test_split_to_requested_count_and_pad_with_empty_when_too_few_samples():
    mbs = split_into_micro_batches(LENGTHS, 64, num_micro_batches=9)
    assert len(mbs) == 9 and all(mbs) and _flatten(mbs) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in mb) <= 64 for mb in mbs)
    assert split_into_micro_batches([10, 20], 64, num_micro_batches=3) == [[0], [1], []]
    with pytest.raises(ValueError, match="num_micro_batches"):
        split_into_micro_batches(LENGTHS, 64, num_micro_batches=2)


def test_too_long_sample_is_a_clear_error():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=50"):
        first_fit_decreasing(LENGTHS, 50)


def test_partition_balances_tokens():
    ranks = partition_across_ranks(LENGTHS, 3)
    assert _flatten(ranks) == list(range(len(LENGTHS)))
    loads = [sum(LENGTHS[i] for i in r) for r in ranks]
    assert max(loads) - min(loads) <= max(LENGTHS)
    assert sorted(loads) == [85, 85, 86]


@pytest.mark.parametrize("dp_size,budget", [(1, 64), (2, 64), (3, 80), (4, 60)])
def test_every_rank_gets_the_same_number_of_micro_batches(dp_size, budget):
    plan = dynamic_micro_batches(LENGTHS, dp_size, budget)
    assert len({len(rank) for rank in plan}) == 1
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in mb) <= budget for rank in plan for mb in rank)


def test_balanced_micro_batches_on_given_rank_lengths():
    plan = balanced_micro_batches([[60, 60, 60], [10, 10]], 64)
    assert plan == [[[0], [1], [2]], [[0], [1], []]]  # rank 1 has 2 samples for 3 steps: one empty step


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 32))


def _token_losses(model, sequences):
    """Next-token cross-entropy per predicting token of a packed micro-batch: [N - S]."""
    packed = pack_sequences(sequences)
    targets_N = next_token_targets(packed)[0]
    losses_N = torch.nn.functional.cross_entropy(model(packed.input_ids_1N[0]), targets_N, reduction="none")
    has_target_N = torch.ones_like(targets_N, dtype=torch.bool)
    has_target_N[packed.cu_seqlens[1:].long() - 1] = False
    return losses_N[has_target_N]


def test_split_loss_and_gradient_equal_unsplit():
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 32, (n,), generator=g) for n in LENGTHS]
    num_targets = sum(n - 1 for n in LENGTHS)

    model = _tiny_model()
    full_loss = _token_losses(model, sequences).mean()
    full_loss.backward()
    full_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    split_loss = torch.zeros(())
    for rank_plan in dynamic_micro_batches(LENGTHS, dp_size=3, max_tokens_per_micro_batch=64):
        for mb in rank_plan:  # gradients accumulate; summing over ranks stands in for all-reduce(SUM)
            if mb:
                loss = _token_losses(model, [sequences[i] for i in mb]).sum() / num_targets
                loss.backward()
                split_loss += loss.detach()
    torch.testing.assert_close(split_loss, full_loss.detach(), atol=1e-6, rtol=1e-6)
    for p, want in zip(model.parameters(), full_grads):
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-5)
