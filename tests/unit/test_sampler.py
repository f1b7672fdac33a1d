"""The resumable data-parallel sampler: disjoint shares, epoch reshuffles, OpenRLHF's order, resume."""

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from rlhf.data.sampler import DistributedBatchSampler


def samplers(num_samples, global_batch_size, dp_size, seed=7):
    return [DistributedBatchSampler(num_samples, global_batch_size, dp_size, rank, seed) for rank in range(dp_size)]


@pytest.mark.parametrize("num_samples,global_batch_size,dp_size", [(23, 6, 3), (16, 4, 4), (10, 10, 2), (9, 2, 1)])
def test_shares_are_disjoint_equal_and_make_the_global_batch(num_samples, global_batch_size, dp_size):
    ranks = samplers(num_samples, global_batch_size, dp_size)
    steps = ranks[0].steps_per_epoch
    assert steps == num_samples // global_batch_size
    seen = []
    for step in range(steps):
        shares = [r.indices(step) for r in ranks]
        assert all(len(share) == global_batch_size // dp_size for share in shares)
        assert sorted(sum(shares, [])) == sorted(ranks[0].global_batch(step))
        assert all(r.global_batch(step) == ranks[0].global_batch(step) for r in ranks)
        seen += sum(shares, [])
    # one epoch: every sample at most once, and all but the dropped remainder
    assert len(seen) == len(set(seen)) == steps * global_batch_size
    assert set(seen) <= set(range(num_samples))


def test_epochs_reshuffle_deterministically():
    sampler = DistributedBatchSampler(12, 4, 2, 0, seed=3)
    assert sampler.steps_per_epoch == 3
    epoch0 = sum((sampler.global_batch(s) for s in range(3)), [])
    epoch1 = sum((sampler.global_batch(s) for s in range(3, 6)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and epoch0 != epoch1
    again = DistributedBatchSampler(12, 4, 2, 0, seed=3)
    assert [again.indices(s) for s in range(6)] == [sampler.indices(s) for s in range(6)]
    other_seed = DistributedBatchSampler(12, 4, 2, 0, seed=4)
    assert [other_seed.global_batch(s) for s in range(3)] != [sampler.global_batch(s) for s in range(3)]
    ordered = DistributedBatchSampler(12, 4, 2, 1, seed=3, shuffle=False)
    assert ordered.global_batch(1) == [4, 5, 6, 7] and ordered.indices(1) == [5, 7]


@pytest.mark.parametrize("num_samples,global_batch_size,dp_size", [(23, 6, 3), (20, 8, 2), (7, 2, 1)])
def test_same_batches_as_torch_distributed_sampler_and_dataloader(num_samples, global_batch_size, dp_size):
    seed = 11
    for rank, ours in enumerate(samplers(num_samples, global_batch_size, dp_size, seed)):
        theirs = DistributedSampler(range(num_samples), num_replicas=dp_size, rank=rank, shuffle=True, seed=seed,
                                    drop_last=True)
        for epoch in range(3):
            theirs.set_epoch(epoch)
            batches = list(BatchSampler(theirs, global_batch_size // dp_size, drop_last=True))
            assert len(batches) == ours.steps_per_epoch
            start = epoch * ours.steps_per_epoch
            assert batches == [ours.indices(start + k) for k in range(len(batches))]


def test_resume_from_state_equals_uninterrupted_run():
    uninterrupted = DistributedBatchSampler(30, 6, 2, 1, seed=5)
    expected = [uninterrupted.next() for _ in range(17)]  # crosses three epoch boundaries
    first = DistributedBatchSampler(30, 6, 2, 1, seed=5)
    head = [first.next() for _ in range(8)]
    state = first.state_dict()
    resumed = DistributedBatchSampler(30, 6, 2, 1, seed=5)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    tail = [next(iterator) for _ in range(9)]
    assert head + tail == expected
    assert resumed.state_dict()["step"] == 17


def test_resume_with_another_dp_size_keeps_the_global_batches():
    before = samplers(30, 6, 2, seed=5)
    for sampler in before:
        for _ in range(4):
            sampler.next()
    after = samplers(30, 6, 3, seed=5)
    for sampler in after:
        sampler.load_state_dict(before[0].state_dict())
    assert sorted(sum((s.next() for s in after), [])) == sorted(before[0].global_batch(4))


def test_errors():
    with pytest.raises(ValueError, match=r"--train_batch_size 6 must be a positive multiple of the data-parallel "
                                         r"size 4"):
        DistributedBatchSampler(30, 6, 4, 0, seed=0)
    with pytest.raises(ValueError, match=r"only 5 samples but --train_batch_size is 6"):
        DistributedBatchSampler(5, 6, 2, 0, seed=0)
    with pytest.raises(ValueError, match=r"dp_rank 2 is outside a data-parallel group of 2"):
        DistributedBatchSampler(30, 6, 2, 2, seed=0)
    state = DistributedBatchSampler(30, 6, 2, 0, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"cannot resume the data order: seed 0 -> 1"):
        DistributedBatchSampler(30, 6, 2, 0, seed=1).load_state_dict(state)


def test_permutation_is_torch_randperm_of_seed_plus_epoch():
    sampler = DistributedBatchSampler(10, 5, 1, 0, seed=2)
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    assert sampler.global_batch(2) + sampler.global_batch(3) == expected
