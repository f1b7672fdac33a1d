"""(the floors of `rl_step.py`; launched by it under torchrun on as many ranks as the measured run) Replays,
step by step, what each rank of the measured run did, with no trainer around:

- generation: the same rollout engine (built by `build_rollout_engine` from the same flags) on the same
  prompts, sampling settings and seeds (each rank replays its own recorded generate calls);
- experience: a plain `no_grad` forward + token log-probs of the same sequences, cut into the same
  --micro_rollout_batch_size micro-batches (same padding: right-padded rows trimmed per micro-batch);
- train: plain PyTorch forward + PPO-clip loss + backward + `torch.optim.AdamW` over the same micro-batches,
  one optimizer step per recorded optimizer step, no DeepSpeed and no gradient communication;
- weight sync: `copy_` of every parameter into preallocated tensors (the bytes one push moves);
- and, for reference only, a gloo all-reduce of one gradient's worth of fp32 (what ZeRO's reduction moves).

Each stage starts after a barrier, so the ranks run it concurrently as in the run (they share the cores);
per rank and step the seconds go to $RL_STEP_FLOORS/rank{RANK}.pt. Environment: RL_STEP_RUNS (comma-separated
run directories holding the trainer ranks' records) and RL_STEP_MODES (matching: fixed or natural).
Arguments: train_ppo's flags, as given to the run.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from rl_step_hooks import IGNORE_EOS, install_ignore_eos, peak_rss_bytes
from transformers import AutoModelForCausalLM

from rlhf.cli.common import for_this_machine
from rlhf.cli.train_ppo import build_rollout_engine
from rlhf.config.flags import parse_config
from rlhf.config.ppo import TrainPPOConfig
from rlhf.distributed.launch import init_distributed, read_launch_env
from rlhf.models.loading import load_tokenizer


def trim(seq_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = int(mask_BT.sum(-1).max())
    return seq_BT[:, :width], mask_BT[:, :width]


def token_logprobs_BT1(model, seq_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=seq_BT, attention_mask=mask_BT, use_cache=False).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, seq_BT[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def experience_floor(model, seq_BT: torch.Tensor, mask_BT: torch.Tensor, micro: int) -> None:
    for start in range(0, seq_BT.shape[0], micro):
        token_logprobs_BT1(model, *trim(seq_BT[start:start + micro], mask_BT[start:start + micro]))


def train_floor(model, optimizer: torch.optim.Optimizer, micro_batches: list, clip: float = 0.2) -> None:
    """One optimizer step: PPO-clip token loss summed over the step's action tokens / their count."""
    num_tokens = max(sum(float(e.action_mask_BT1.sum()) for e in micro_batches), 1.0)
    for exp in micro_batches:
        logprobs = token_logprobs_BT1(model, exp.sequences_BT, exp.attention_mask_BT)
        width = logprobs.shape[1]
        old, adv = exp.old_logprobs_BT1[:, :width], exp.advantages_BT1[:, :width]
        ratio = (logprobs - old).exp()
        loss_BT1 = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        ((loss_BT1 * exp.action_mask_BT1[:, :width]).sum() / num_tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def by_step(calls: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for step, args in calls:
        out.setdefault(step, []).append(args)
    return out


def replay(record: dict, engine, model, optimizer, micro_rollout: int) -> dict[int, dict[str, float]]:
    """Seconds per step of each floor on this rank, and the tokens the standalone engine generated."""
    gens, exps, trains = (by_step(record["calls"].get(k, [])) for k in
                          ("engine_generate", "actor_logprobs", "actor_train_batch"))
    params = [p.detach() for p in model.parameters()]
    buffers = [torch.empty_like(p) for p in params]
    grad_flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
    out = {}
    for step in sorted(gens):
        tokens = []

        def generate(step=step, tokens=tokens):
            for prompts, spec, seeds in gens[step]:
                tokens.extend(len(g.token_ids) for per_prompt in engine.generate(prompts, spec, seeds)
                              for g in per_prompt)

        def copy():
            for dst, src in zip(buffers, params):
                dst.copy_(src)

        out[step] = {
            "generation": timed(generate),
            "experience": timed(lambda step=step: [experience_floor(model, s, m, micro_rollout)
                                                   for s, m in exps.get(step, [])]),
            "train": timed(lambda step=step: [train_floor(model, optimizer, micro) for micro in trains.get(step, [])]),
            "weight_sync": timed(copy),
            "grad_allreduce": timed(lambda: dist.all_reduce(grad_flat)),
            "generated_tokens": float(sum(tokens)),
        }
    return out


def main() -> None:
    cfg = for_this_machine(parse_config(TrainPPOConfig, sys.argv[1:], prog="rl_step_floors").with_demo_defaults())
    launch = read_launch_env()
    device = init_distributed(launch, cfg.dist_timeout)
    install_ignore_eos()
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.model.trust_remote_code)
    engine = build_rollout_engine(cfg, device, tokenizer)
    torch.manual_seed(cfg.seed + launch.rank)  # vLLM re-seeds globally
    model = AutoModelForCausalLM.from_pretrained(cfg.model.pretrain, dtype=cfg.model.dtype,
                                                 attn_implementation=cfg.model.attn).to(device)
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.actor_learning_rate, betas=tuple(o.adam_betas),
                                  weight_decay=o.l2)
    results = {"floors": {}}
    for run_dir, mode in zip(os.environ["RL_STEP_RUNS"].split(","), os.environ["RL_STEP_MODES"].split(",")):
        IGNORE_EOS["on"] = mode == "fixed"
        record = torch.load(os.path.join(run_dir, f"rank{launch.rank}.pt"), weights_only=False)
        model.train()
        results["floors"][mode] = replay(record, engine, model, optimizer, cfg.batch.micro_rollout_batch_size)
    results["peak_rss_bytes"] = peak_rss_bytes()
    results["num_params"] = sum(p.numel() for p in model.parameters())
    results["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    results["engine"] = type(engine).__name__
    torch.save(results, os.path.join(os.environ["RL_STEP_FLOORS"], f"rank{launch.rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
