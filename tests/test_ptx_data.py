"""The ptx loss walks its pretraining data like any dataset: different batches on different
data-parallel replicas, new batches on every step, every batch once per pass, and a position that a
checkpoint restores exactly."""

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


def _train_two_steps_with_ptx() -> list[list[int]]:
    """Two actor optimizer steps (two micro-batches each) with the ptx loss on; the ptx batches drawn."""
    import torch.distributed as dist

    from rlhf.config.ppo import AlgoConfig
    from tests.test_dp_equivalence import MICRO, build_actor, synthetic_experiences

    dp, rank = dist.get_world_size(), dist.get_rank()
    actor = build_actor(2, 1e-3, grad_accum_steps=2, algo=AlgoConfig(ptx_coef=0.1))
    vocab = actor.model.module.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(4, vocab, (MICRO, 5), generator=g), torch.ones(MICRO, 5, dtype=torch.long))
               for _ in range(8)]
    data = PtxData(batches, dp_size=dp, dp_rank=rank, seed=4)
    seen: list[list[int]] = []
    draw = data.next
    data.next = lambda: seen[-1].append(data.index(data.position)) or draw()
    exp = synthetic_experiences(vocab)
    exp.old_logprobs_BT1 = actor.logprobs(exp.sequences_BT, exp.attention_mask_BT) * exp.action_mask_BT1
    for _ in range(2):
        seen.append([])
        actor.train_batch([exp.slice(0, MICRO), exp.slice(MICRO, 2 * MICRO)], kl_coef=0.0, ptx=data)
    return seen


def test_actor_steps_walk_the_ptx_data_over_steps_and_ranks():
    from tests.distributed import run_on_ranks

    rank0, rank1 = run_on_ranks(2, _train_two_steps_with_ptx)
    assert all(len(step) == 2 for step in rank0 + rank1), "one ptx batch per training micro-batch"
    for step in range(2):
        assert not set(rank0[step]) & set(rank1[step]), "the two replicas draw different batches"
    assert sorted(rank0[0] + rank1[0] + rank0[1] + rank1[1]) == list(range(8)), "two steps cover the 8 batches"
