"""Every family of the zoo under ZeRO-3 on 2 ranks (sharded parameters; MoE blocks as leaf modules) takes the same
first SFT step as the plain model in one process on the whole batch: the same loss before the step, and the same
weights after it (AdamW's bound, `tests.tiny_runs.assert_adam_weights_close`), gathered through `full_parameters`
(what the vLLM push and the HF export read)."""

from __future__ import annotations

import torch

from rlhf.models.zoo import FAMILIES
from tests.distributed import run_on_ranks

LR = 1e-2
ZERO3_FAMILIES = list(FAMILIES)


def _batch(vocab: int):
    """Four right-padded rows of 6-17 tokens (past the zoo's 8-token sliding windows) and their loss mask."""
    g = torch.Generator().manual_seed(3)
    lengths, T = torch.tensor([6, 17, 11, 14]), 17
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return torch.randint(3, vocab, (4, T), generator=g) * mask, mask


def _nll(model, ids, mask, num_tokens: float):
    from rlhf.models.lm_logprobs import policy_forward

    logprobs = policy_forward(model, ids, mask).logprobs_BT1
    return -(logprobs * mask[:, 1:]).sum() / num_tokens


def _zero3_steps(paths: list[str]) -> list[dict]:
    """Each rank, for each model: its half of the batch through a ZeRO-3 DeepSpeedModel, one step; the summed
    loss and the gathered weights."""
    import torch.distributed as dist

    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm

    rank = dist.get_rank()
    results = []
    for path in paths:
        model = DeepSpeedModel(lambda p=path: load_causal_lm(p, torch.float32, "sdpa"), EngineConfig(zero_stage=3),
                               OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=LR,
                               bf16=False, micro_batch_size=2, grad_accum_steps=1, num_optimizer_steps=1,
                               device=torch.device("cpu"), dp_group=dist.group.WORLD)
        ids, mask = _batch(model.module.config.vocab_size)
        num_tokens = float(mask[:, 1:].sum())
        model.train()
        loss = _nll(model.engine, ids[2 * rank: 2 * rank + 2], mask[2 * rank: 2 * rank + 2], num_tokens)
        model.backward(loss, last_micro_batch=True)  # a share of the global token mean; summed over the ranks
        model.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        results.append({"loss": float(total), "weights": dict(model.full_parameters())})
    return results


def test_zero3_step_equals_the_plain_step_on_every_family(tmp_path):
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.zoo import build_family
    from tests.tiny_runs import assert_adam_weights_close

    names = ZERO3_FAMILIES
    paths = [build_family(name, str(tmp_path / name)) for name in names]
    per_rank = run_on_ranks(2, _zero3_steps, paths)
    for i, (name, path) in enumerate(zip(names, paths)):
        model = load_causal_lm(path, torch.float32, "sdpa")
        ids, mask = _batch(model.config.vocab_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
        loss = _nll(model, ids, mask, float(mask[:, 1:].sum()))
        loss.backward()
        loss = loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        want = {n: p.detach() for n, p in model.named_parameters()}
        for rank_results in per_rank:
            got = rank_results[i]
            assert abs(got["loss"] - loss) < 1e-5, (name, got["loss"], loss)
            assert got["weights"].keys() == want.keys(), name
            assert_adam_weights_close(want, got["weights"], LR, 1, what=f"{name} ZeRO-3")
