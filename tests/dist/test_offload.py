"""DeepSpeed state offload really moves the optimizer's fp32 master weights (at ZeRO-3 its gradient shard and reduce
bucket too) into other buffers and brings them back unchanged: training with an offload/reload between steps equals
training without."""

import torch

from tests.distributed import run_variants_on_ranks
from tests.tiny_actor import GLOBAL_BATCH, MICRO, build_actor, synthetic_experiences


def _two_steps(zero_stage: int, offload: bool) -> dict:
    torch.manual_seed(0)
    actor = build_actor(zero_stage, 1e-2, GLOBAL_BATCH // MICRO)
    exp = synthetic_experiences(actor.model.module.config.vocab_size)
    exp.old_logprobs_BT1 = actor.logprobs(exp.sequences_BT, exp.attention_mask_BT)
    micro = [exp.slice(s, s + MICRO) for s in range(0, GLOBAL_BATCH, MICRO)]
    moved = None
    for step in range(2):
        actor.train_batch(micro, kl_coef=0.0)
        if offload and step == 0:
            optimizer = actor.model.engine.optimizer
            masters = optimizer.single_partition_of_fp32_groups if zero_stage < 3 else \
                optimizer.fp32_partitioned_groups_flat
            before = [t.data_ptr() for t in masters]
            actor.model.offload()
            moved = all(a != b for a, b in zip([t.data_ptr() for t in masters], before))
            if zero_stage == 3:  # the gradient shard (a no-op move on CPU) and the reduce bucket leave too
                assert {s.value for s in optimizer.offloaded_states} == {"lp_grads", "contiguous_grad_buffer"}
                assert all(b.buffer is None for b in optimizer.ipg_buckets.values())
            actor.model.reload(torch.device("cpu"))
            if zero_stage == 3:
                assert not optimizer.offloaded_states
                assert all(b.buffer is not None for b in optimizer.ipg_buckets.values())
    return {"moved": moved, "weights": dict(actor.model.full_parameters())}


def test_offload_moves_state_and_changes_nothing():
    variants = [(2, False), (2, True), (3, False), (3, True)]  # (ZeRO stage, offload); ZeRO-3 last
    (plain2,), (offloaded2,), (plain3,), (offloaded3,) = run_variants_on_ranks(1, [(_two_steps, *v) for v in variants])
    for zero_stage, plain, offloaded in ((2, plain2, offloaded2), (3, plain3, offloaded3)):
        assert offloaded["moved"] is True, zero_stage
        for name, weight in plain["weights"].items():
            torch.testing.assert_close(offloaded["weights"][name], weight, rtol=0, atol=0,
                                       msg=f"ZeRO-{zero_stage} {name}")
