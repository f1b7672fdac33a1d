"""Weight buckets keep `full_parameters` order and one dtype each and respect the byte limit; a CPU engine whose KV
cache cannot hold one call's sequences at full length says so, with the size that would."""


import torch

from rlhf.engines.weight_sync import ParamSpec, buckets

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


def test_kv_cache_shortfall_names_the_flag_and_the_size_that_fits():
    from rlhf.engines.vllm_engine import kv_cache_shortfall

    # 8208-token sequences take 65 blocks of 128: 512 blocks (64 MiB) hold 7 of them, 8 need 520 blocks
    note = kv_cache_shortfall(64 << 20, 512, 128, 8208, 8)
    assert "holds 7 sequences of 8208 tokens" in note and "fewer than the 8 each engine" in note
    assert f"--vllm_kv_cache_bytes {520 * (64 << 20) // 512} " in note
    assert kv_cache_shortfall(64 << 20, 512, 128, 8208, 7) is None
    assert kv_cache_shortfall(64 << 20, 512, 128, 128, 512) is None
