"""Weight streaming from the actor's first rank: buckets keep `full_parameters` order and one dtype each,
and a broadcast of a mixed-dtype parameter list gives every rank the source's tensors exactly."""

import torch

from rlhf.engines.weight_sync import ParamSpec, broadcast_parameters, buckets
from tests.distributed import run_on_ranks

MIXED = [ParamSpec("embed", (4, 3), torch.float32), ParamSpec("norm", (3,), torch.float32),
         ParamSpec("q", (3, 3), torch.bfloat16), ParamSpec("k", (3, 3), torch.bfloat16),
         ParamSpec("head", (2, 3), torch.float32)]


def test_buckets_split_on_dtype_change_and_keep_order():
    groups = buckets(MIXED, bucket_bytes=1 << 20)
    assert [[s.name for s in g] for g in groups] == [["embed", "norm"], ["q", "k"], ["head"]]
    assert all(len({s.dtype for s in g}) == 1 for g in groups)


def test_buckets_respect_the_byte_limit_within_a_dtype():
    # embed 48 B, norm 12 B, q/k 18 B each, head 24 B: a 50-byte limit splits embed|norm and keeps q+k.
    groups = buckets(MIXED, bucket_bytes=50)
    assert [[s.name for s in g] for g in groups] == [["embed"], ["norm"], ["q", "k"], ["head"]]
    big = [ParamSpec("a", (100,), torch.float32), ParamSpec("b", (1,), torch.float32)]
    assert [[s.name for s in g] for g in buckets(big, bucket_bytes=8)] == [["a"], ["b"]]


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(s.name, torch.randn(s.shape, generator=g).to(s.dtype)) for s in MIXED]


def _receive_mixed(bucket_bytes: int) -> list[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    local = iter(_mixed_tensors()) if dist.get_rank() == 0 else None
    return [(name, t.clone()) for name, t in
            broadcast_parameters(local, MIXED, src=0, bucket_bytes=bucket_bytes, device=torch.device("cpu"))]


def test_broadcast_of_mixed_dtypes_reaches_every_rank():
    expected = _mixed_tensors()
    for received in run_on_ranks(2, _receive_mixed, 1 << 20):
        assert [name for name, _ in received] == [name for name, _ in expected]
        for (name, got), (_, want) in zip(received, expected):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), name
