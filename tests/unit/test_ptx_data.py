"""The ptx loss walks its pretraining data like any dataset: different batches on different replicas, passes that
move on, and a position that round-trips through a checkpoint."""

import torch

from rlhf.data.pretrain import PtxData


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, 3), i), torch.ones(2, 3, dtype=torch.long)) for i in range(n)]


def _seen(data: PtxData, draws: int) -> list[int]:
    return [int(data.next()[0][0, 0]) for _ in range(draws)]


def test_replicas_split_each_pass_and_steps_move_on():
    batches = _batches(12)
    replicas = [PtxData(batches, dp_size=2, dp_rank=r, seed=3) for r in range(2)]
    # three steps of two micro-batches on each replica: 12 draws in all = one pass over the data
    per_step = [[_seen(d, 2) for d in replicas] for _ in range(3)]
    drawn = [b for step in per_step for rep in step for b in rep]
    assert sorted(drawn) == list(range(12)), "one pass visits every batch exactly once"
    for step in per_step:
        assert not set(step[0]) & set(step[1]), "replicas of one step see different batches"
    assert per_step[0][0] != per_step[1][0], "the next step does not repeat the first one's batches"
    # the second pass is another order of the same batches
    second = [b for _ in range(3) for d in replicas for b in _seen(d, 2)]
    assert sorted(second) == list(range(12)) and second != drawn


def test_position_round_trips_through_a_checkpoint():
    batches = _batches(5)
    straight = PtxData(batches, dp_size=1, dp_rank=0, seed=1)
    expected = _seen(straight, 13)
    first = PtxData(batches, dp_size=1, dp_rank=0, seed=1)
    head = _seen(first, 6)
    resumed = PtxData(batches, dp_size=1, dp_rank=0, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert head + _seen(resumed, 7) == expected
