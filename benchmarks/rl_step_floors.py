"""(the floors of `rl_step.py`; launched by it under torchrun on as many ranks as the measured run) Replays,
step by step, what each rank of the measured run did, with no trainer around:

- generation: the same rollout engine (built by `build_rollout_engine` from the same flags) on the same
  prompts, sampling settings and seeds (each rank replays its own recorded generate calls);
- experience: a plain `no_grad` forward + token log-probs of the same sequences (the actor's forward, and the
  reference model's where the run has one), in the same --micro_rollout_batch_size micro-batches, packed (real
  tokens only, the project's varlen attention);
- train: plain PyTorch forward + PPO-clip loss + backward + `torch.optim.AdamW` over the same micro-batches,
  packed, one optimizer step per recorded optimizer step, no DeepSpeed and no gradient communication;
- weight sync: `copy_` of every parameter into preallocated tensors (the bytes one push moves);
- references, not floors: the experience and train forwards again right-padded (trimmed per micro-batch, as
  the run computes them without --packing_samples; skipped when the run packs), and a gloo all-reduce of one
  fp32 gradient (what ZeRO's gradient reduction moves).

Each stage starts after a barrier, so the ranks run it concurrently as in the run (they share the cores);
per rank and step the wall and CPU seconds, and the padding of the forwards, go to
$RL_STEP_FLOORS/rank{RANK}.pt. Environment: RL_STEP_RUNS (comma-separated run directories holding the trainer
ranks' records) and RL_STEP_MODES (matching: fixed or natural). Arguments: train_ppo's flags, as given to the
run. Shape legend: B rows, T padded positions, N packed tokens.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from rl_step_hooks import IGNORE_EOS, install_ignore_eos, peak_rss_bytes, torch_threads
from rlhf.kernels import next_token_targets, pack_padded, unpack_to_padded
from transformers import AutoModelForCausalLM

from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.core.run import for_this_machine
from rlhf.distributed.launch_env import init_distributed, read_launch_env
from rlhf.models.attention import register_varlen_attention
from rlhf.models.loading import load_tokenizer
from rlhf.trainers.ppo_run import build_rollout_engine


class Plain:
    """A plain transformers model and its AdamW; `packed`: forwards take packed rows (varlen attention)."""

    def __init__(self, cfg: TrainPPOConfig, device: torch.device, packed: bool) -> None:
        attn = register_varlen_attention() if packed else cfg.model.attn
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.pretrain, dtype=cfg.model.dtype,
                                                          attn_implementation=attn).to(device).train()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.actor_learning_rate,
                                           betas=tuple(o.adam_betas), weight_decay=o.l2)
        self.packed = packed

    def logprobs_BT1(self, seq_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """float32 [B, T-1] log-probs of each next token (zero-padded past each row's end)."""
        if not self.packed:
            logits = self.model(input_ids=seq_BT, attention_mask=mask_BT, use_cache=False).logits.float()
            return logits[:, :-1].log_softmax(-1).gather(-1, seq_BT[:, 1:, None]).squeeze(-1)
        packed = pack_padded(seq_BT, mask_BT)
        logits_1N = self.model(**packed.forward_kwargs()).logits.float()
        logprobs_1N = logits_1N.log_softmax(-1).gather(-1, next_token_targets(packed)[..., None]).squeeze(-1)
        return unpack_to_padded(logprobs_1N, packed, seq_BT.shape[1])[:, :-1]

    @torch.no_grad()
    def experience(self, seq_BT: torch.Tensor, mask_BT: torch.Tensor, micro: int) -> None:
        for start in range(0, seq_BT.shape[0], micro):
            self.logprobs_BT1(*trim(seq_BT[start:start + micro], mask_BT[start:start + micro]))

    def train(self, micro_batches: list, clip: float = 0.2) -> None:
        """One optimizer step: PPO-clip token loss summed over the step's action tokens / their count."""
        num_tokens = max(sum(float(e.action_mask_BT1.sum()) for e in micro_batches), 1.0)
        for exp in micro_batches:
            logprobs = self.logprobs_BT1(exp.sequences_BT, exp.attention_mask_BT)
            width = logprobs.shape[1]
            adv = exp.advantages_BT1[:, :width]
            # the run skipped the experience forward (one update per batch): its ratio is exactly 1
            old = logprobs.detach() if exp.old_logprobs_BT1 is None else exp.old_logprobs_BT1[:, :width]
            ratio = (logprobs - old).exp()
            loss_BT1 = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
            ((loss_BT1 * exp.action_mask_BT1[:, :width]).sum() / num_tokens).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def trim(seq_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = int(mask_BT.sum(-1).max())
    return seq_BT[:, :width], mask_BT[:, :width]


def real_and_computed(masks: list[torch.Tensor]) -> tuple[float, float]:
    """(real tokens, positions computed) of right-padded micro-batches, each trimmed to its longest row."""
    return (sum(float(m.sum()) for m in masks),
            sum(float(m.shape[0] * int(m.sum(-1).max())) for m in masks if m.numel()))


def timed(fn, cpu: dict[str, float], name: str) -> float:
    """Wall seconds of `fn()` started at a barrier; its CPU seconds (this process) go to cpu[name]."""
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    cpu[name] = time.process_time() - cpu_start
    return time.perf_counter() - start


def by_step(calls: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for step, args in calls:
        out.setdefault(step, []).append(args)
    return out


def replay_step(work: dict, engine, plains: dict[str, Plain], micro_rollout: int, params: list[torch.Tensor],
                buffers: list[torch.Tensor], grad_flat: torch.Tensor) -> dict:
    """One step's floors and references on this rank: wall seconds per name, CPU seconds under "cpu"."""
    tokens: list[int] = []
    cpu: dict[str, float] = {}

    def generate():
        for prompts, spec, seeds in work["generate"]:
            tokens.extend(len(g.token_ids) for per_prompt in engine.generate(prompts, spec, seeds) for g in per_prompt)

    def copy():
        for dst, src in zip(buffers, params):
            dst.copy_(src)

    out = {"generation": timed(generate, cpu, "generation")}
    for suffix, plain in (("", plains["packed"]), ("_padded", plains.get("padded"))):
        if plain is not None:
            out[f"experience{suffix}"] = timed(
                lambda p=plain: [p.experience(s, m, micro_rollout) for s, m in work["logprobs"] + work["ref_logprobs"]],
                cpu,
                "experience" + suffix)
            out[f"train{suffix}"] = timed(lambda p=plain: [p.train(micro) for micro in work["train"]], cpu,
                                          "train" + suffix)
    out["weight_sync"] = timed(copy, cpu, "weight_sync")
    out["grad_allreduce"] = timed(lambda: dist.all_reduce(grad_flat), cpu, "grad_allreduce")
    exp_masks = [m[i:i + micro_rollout] for _, m in work["logprobs"] + work["ref_logprobs"]
                 for i in range(0, m.shape[0], micro_rollout)]
    return {**out, "cpu": cpu, "generated_tokens": float(sum(tokens)),
            "experience_tokens": real_and_computed(exp_masks),
            "train_tokens": real_and_computed([e.attention_mask_BT for micro in work["train"] for e in micro])}


def replay(record: dict, engine, plains: dict[str, Plain], micro_rollout: int) -> dict[int, dict]:
    """`replay_step` for every step the run recorded (step 1 included: the driver drops it as warm-up)."""
    calls = {name: by_step(record["calls"].get(key, [])) for name, key in
             (("generate", "engine_generate"), ("logprobs", "actor_logprobs"), ("ref_logprobs", "ref_logprobs"),
              ("train", "actor_train_batch"))}
    params = [p.detach() for p in plains["packed"].model.parameters()]
    buffers = [torch.empty_like(p) for p in params]
    grad_flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
    return {step: replay_step({name: c.get(step, []) for name, c in calls.items()}, engine, plains, micro_rollout,
                              params, buffers, grad_flat)
            for step in sorted(calls["generate"])}


def main() -> None:
    cfg = for_this_machine(parse_config(TrainPPOConfig, sys.argv[1:], prog="rl_step_floors").with_demo_defaults())
    launch = read_launch_env()
    device = init_distributed(launch, cfg.dist_timeout)
    install_ignore_eos()
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.model.trust_remote_code)
    engine = build_rollout_engine(cfg.rollout, cfg.model, device, tokenizer, seed=cfg.seed,
                                  max_model_len=cfg.max_model_len)
    torch.manual_seed(cfg.seed + launch.rank)  # vLLM re-seeds globally
    plains = {"packed": Plain(cfg, device, packed=True)}
    if not cfg.engine.packing_samples:
        plains["padded"] = Plain(cfg, device, packed=False)
    results = {"floors": {}}
    for run_dir, mode in zip(os.environ["RL_STEP_RUNS"].split(","), os.environ["RL_STEP_MODES"].split(",")):
        IGNORE_EOS["on"] = mode == "fixed"
        record = torch.load(os.path.join(run_dir, f"rank{launch.rank}.pt"), weights_only=False)
        results["floors"][mode] = replay(record, engine, plains, cfg.batch.micro_rollout_batch_size)
    params = list(plains["packed"].model.parameters())
    results.update(peak_rss_bytes=peak_rss_bytes(), num_params=sum(p.numel() for p in params),
                   param_bytes=sum(p.numel() * p.element_size() for p in params), engine=type(engine).__name__,
                   threads=torch_threads())
    torch.save(results, os.path.join(os.environ["RL_STEP_FLOORS"], f"rank{launch.rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
