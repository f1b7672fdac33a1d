"""Weight streaming from the actor's first rank: a broadcast of a mixed-dtype parameter list gives every rank the
source's tensors exactly; the uncopied stream stays valid and skips the clone below ZeRO-3; the vLLM push (both
in-place paths): an engine pushed weights W generates exactly what it generated when freshly loaded from W,
and a push of other weights changes its generations."""

import warnings

import pytest
import torch

from rlhf.engines.weight_sync import ParamSpec, broadcast_parameters
from tests.distributed import run_on_ranks, run_variants_on_ranks

MIXED = [ParamSpec("embed", (4, 3), torch.float32), ParamSpec("norm", (3,), torch.float32),
         ParamSpec("q", (3, 3), torch.bfloat16), ParamSpec("k", (3, 3), torch.bfloat16),
         ParamSpec("head", (2, 3), torch.float32)]


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


def _uncopied_stream(zero_stage: int) -> dict:
    """The whole `full_parameters(copy=False)` stream kept (every ZeRO-3 gather released by then) against the
    cloned stream, and whether below ZeRO-3 it hands out the live parameters themselves."""
    from tests.tiny_actor import build_actor

    model = build_actor(zero_stage, 1e-3, grad_accum_steps=1).model
    views = list(model.full_parameters(copy=False))
    copies = list(model.full_parameters())
    live_ptrs = {p.data_ptr() for p in model.module.parameters()}
    return {"names": [n for n, _ in views] == [n for n, _ in copies],
            "equal": all(torch.equal(v, c) for (_, v), (_, c) in zip(views, copies)),
            "aliases_live": all(v.data_ptr() in live_ptrs for _, v in views),
            "copies_alias_live": any(c.data_ptr() in live_ptrs for _, c in copies)}


def test_uncopied_stream_stays_valid_and_skips_the_clone_below_zero3():
    for zero_stage, results in zip((2, 3), run_variants_on_ranks(2, [(_uncopied_stream, 2), (_uncopied_stream, 3)])):
        for out in results:
            assert out["names"] and out["equal"], zero_stage
            assert not out["copies_alias_live"], zero_stage
            assert out["aliases_live"] == (zero_stage < 3), zero_stage


PROMPTS = [[2, 5, 9, 11], [2, 7], [2, 30, 31, 32, 33]]


def _generate(engine) -> tuple[list[list[int]], list[list[float]]]:
    from rlhf.engines.rollout import SamplingSpec

    gens = engine.generate(PROMPTS, SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_tokens=12), [1, 2, 3])
    return [g[0].token_ids for g in gens], [g[0].logprobs for g in gens]


@torch.no_grad()
def _hf_logprobs(model, ids: list[list[int]]) -> list[list[float]]:
    out = []
    for prompt, response in zip(PROMPTS, ids):
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist())
    return out


def _push_round_trip() -> dict:
    """An engine freshly loaded from the embedded policy W samples (fixed seeds); then, on the path the engine
    chose and again on vLLM's `reload_weights`: push W' (W plus noise) and sample, push W back and sample.
    Also the HF model's log-probs, under W', of what the engine sampled under W'."""
    import gc

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.distributed import launch_env
    from rlhf.engines.vllm_engine import RELOAD_IN_PLACE, VLLMEngine
    from rlhf.models.loading import load_causal_lm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = VLLMEngine(EMBEDDED_MODEL_DIR, dtype=torch.float32, tp_size=1, seed=0, max_model_len=64,
                            kv_cache_bytes=16 << 20, gpu_memory_utilization=0.5, enforce_eager=True,
                            enable_prefix_caching=False, enable_sleep=False, sequences_per_call=200)
    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")
    weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    g = torch.Generator().manual_seed(0)
    noisy = [(n, t + 0.5 * t.std() * torch.randn(t.shape, generator=g)) for n, t in weights]
    with torch.no_grad():
        for (_, p), (_, t) in zip(model.named_parameters(), noisy):
            p.copy_(t)
    out = {"path": engine.push_path, "fresh": _generate(engine),
           "kv_warnings": [str(w.message) for w in caught if "--vllm_kv_cache_bytes" in str(w.message)],
           "kv_blocks": engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    for path in (engine.push_path, RELOAD_IN_PLACE):
        engine.push_path = path
        engine.load_weights(iter(noisy))
        ids, lp = _generate(engine)
        out[f"{path} noisy"] = ids, lp, _hf_logprobs(model, ids)
        engine.load_weights(iter(weights))
        out[f"{path} back"] = _generate(engine)
    out["compiled_frames"] = sum(counters["frames"].values())  # --enforce_eager on CPU: nothing went through Dynamo
    # the engine's shutdown at exit: vLLM's own unfreezes and collects the whole heap, ours keeps it frozen
    shutdown = launch_env._CLOSE_BEFORE_GROUPS.pop()
    unfreeze = gc.unfreeze
    gc.unfreeze()
    shutdown()
    out["shutdown"] = {"frozen": gc.get_freeze_count() > 0, "unfreeze_restored": gc.unfreeze is unfreeze,
                       "default_group": dist.is_initialized()}
    return out


@pytest.mark.vllm
def test_vllm_push_reproduces_a_fresh_engine_and_changes_it():
    pytest.importorskip("vllm")
    from rlhf.engines.vllm_engine import COPY_IN_PLACE, RELOAD_IN_PLACE, kv_cache_shortfall

    out = run_on_ranks(1, _push_round_trip)[0]
    assert out["path"] == COPY_IN_PLACE  # an unquantized Llama takes the direct copy
    assert out["compiled_frames"] == 0  # vLLM's sampler compiles its token-rank helper unless told not to
    assert out["shutdown"] == {"frozen": True, "unfreeze_restored": True, "default_group": False}
    # 16 MiB of 128-token blocks at 1 KiB per token (2 layers x k,v x 2 heads x 32 x fp32): 128 blocks, one per
    # 64-token sequence, fewer than the 200 sequences the engine was told one call samples
    assert out["kv_blocks"] == 128
    assert out["kv_warnings"] == [kv_cache_shortfall(16 << 20, 128, 128, 64, 200)]
    assert "holds 128 sequences" in out["kv_warnings"][0] and "--vllm_kv_cache_bytes 26214400 " in out["kv_warnings"][0]
    fresh_ids, fresh_lp = out["fresh"]
    for path in (COPY_IN_PLACE, RELOAD_IN_PLACE):
        ids, lp = out[f"{path} back"]
        assert ids == fresh_ids, path
        assert torch.allclose(torch.tensor(sum(lp, [])), torch.tensor(sum(fresh_lp, [])), atol=1e-6, rtol=0), path
        noisy_ids, noisy_lp, hf_lp = out[f"{path} noisy"]
        assert noisy_ids != fresh_ids, path
        # every layer took W' (a stale linear or norm would move these by far more)
        assert torch.allclose(torch.tensor(sum(noisy_lp, [])), torch.tensor(sum(hf_lp, [])), atol=1e-4, rtol=0), path
