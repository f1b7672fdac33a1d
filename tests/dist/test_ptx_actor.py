"""The actor's ptx loss walks its pretraining data over steps and ranks (different batches per replica)."""

import torch

from rlhf.data.pretrain import PtxData


def _train_two_steps_with_ptx() -> list[list[int]]:
    """Two actor optimizer steps (two micro-batches each) with the ptx loss on; the ptx batches drawn."""
    import torch.distributed as dist

    from rlhf.config.ppo_config import AlgoConfig
    from tests.tiny_actor import MICRO, build_actor, synthetic_experiences

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
