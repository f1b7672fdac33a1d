"""`all_gather_rollout` on 3 gloo ranks holding 3, 2 and 0 samples of different widths equals the rollouts
concatenated in one process, bit for bit (float fields travel by their bits: NaN, -0.0 and the smallest
subnormal survive), Python fields and labels included."""

from __future__ import annotations

import torch

from tests.distributed import run_on_ranks

COUNTS, WIDTHS, PAD = (3, 2, 0), (5, 7, 4), 0


def _local(rank: int):
    from rlhf.data.records import Rollout

    B, T = COUNTS[rank], WIDTHS[rank]
    g = torch.Generator().manual_seed(rank)
    floats = torch.randn(B, T - 1, generator=g)
    if B:
        floats[0, :3] = torch.tensor([float("nan"), -0.0, torch.finfo(torch.float32).smallest_normal / 4])
    return Rollout(sequences_BT=torch.randint(0, 2**40, (B, T), generator=g), attention_mask_BT=torch.ones(B, T).long(),
                   action_mask_BT1=(floats > 0).float(), rollout_logprobs_BT1=floats,
                   prompt_lens_B=torch.arange(B) + 10 * rank, response_lens_B=torch.arange(B) * 2,
                   finish_reasons=["stop", "length", "stop"][:B], prompts=[f"p{rank}{b}" for b in range(B)],
                   responses=[f"r{rank}{b}" for b in range(B)], labels=[{"rank": rank, "b": b} for b in range(B)])


def _gathered():
    import torch.distributed as dist

    from rlhf.distributed.collectives import all_gather_rollout

    return all_gather_rollout(_local(dist.get_rank()), PAD)


def test_the_gathered_rollout_equals_the_concatenated_one_bit_for_bit():
    from dataclasses import fields

    from rlhf.distributed.collectives import concat_rollouts

    expected = concat_rollouts([_local(r) for r in range(3)], PAD)
    assert expected.num_samples == 5 and expected.sequences_BT.shape[1] == 7
    for got in run_on_ranks(3, _gathered):
        for f in fields(expected):
            want, have = getattr(expected, f.name), getattr(got, f.name)
            if torch.is_tensor(want):
                assert have.dtype == want.dtype and have.shape == want.shape, f.name
                bits = torch.int32 if want.dtype == torch.float32 else want.dtype
                assert torch.equal(have.view(bits), want.view(bits)), f.name
            else:
                assert have == want, f.name
