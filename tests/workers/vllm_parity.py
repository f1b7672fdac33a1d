"""Run on the ranks of `tests.distributed.run_on_ranks` (or under torchrun): train one step, push weights into every
rank's vLLM engine, sample, and compare engine log-probs with actor log-probs of the same sequences, single-turn samples
and multi-turn agent episodes (several action spans per row). Rank 0 writes a JSON report.

    torchrun --nproc_per_node 2 tests/workers/vllm_parity.py OUT.json ZERO_STAGE TP
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from rlhf.agents import TurnLimits, load_agent, run_episodes
from rlhf.assets import EMBEDDED_MODEL_DIR, TINY_DIR
from rlhf.distributed.launch_env import init_distributed, read_launch_env
from rlhf.engines.rollout import SamplingSpec, to_rollout
from rlhf.engines.vllm_engine import VLLMEngine
from rlhf.models.loading import load_causal_lm, load_tokenizer
from tests.references import sequence_logprobs
from tests.tiny_actor import build_actor, synthetic_experiences


def main(out_path: str, zero_stage: int, tp: int) -> None:
    launch = read_launch_env()
    init_distributed(launch)
    engine = VLLMEngine(EMBEDDED_MODEL_DIR, dtype=torch.float32, tp_size=tp, seed=0, max_model_len=64,
                        kv_cache_bytes=16 << 20, gpu_memory_utilization=0.5, enforce_eager=True,
                        enable_prefix_caching=False, enable_sleep=False)
    torch.manual_seed(0)
    actor = build_actor(zero_stage, 5e-2, grad_accum_steps=1)
    model = actor.model
    exp = synthetic_experiences(model.module.config.vocab_size)
    exp.old_logprobs_BT1 = actor.logprobs(exp.sequences_BT, exp.attention_mask_BT)
    rank = dist.get_rank()
    actor.train_batch([exp.slice(2 * rank, 2 * rank + 2)], kl_coef=0.0)
    engine.load_weights(model.full_parameters())

    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    texts = ["a copy 3 :", "copy 9 :", "b c copy 0 :"]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    gens = engine.generate(prompt_ids, SamplingSpec(n=4, temperature=1.0, top_p=1.0, max_tokens=12), [5, 6, 7])
    rollout = to_rollout(prompt_ids, gens, tok.pad_token_id, tok, texts, [None] * 3)
    actor_lp = actor.logprobs(rollout.sequences_BT, rollout.attention_mask_BT)
    mask = rollout.action_mask_BT1
    diff = float(((actor_lp - rollout.rollout_logprobs_BT1).abs() * mask).max())
    original = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")
    with torch.no_grad():
        before_lp = sequence_logprobs(original, rollout.sequences_BT, rollout.attention_mask_BT)
    moved = float(((before_lp - rollout.rollout_logprobs_BT1).abs() * mask).max())
    report = {"max_abs_diff": diff, "diff_vs_initial_weights": moved, "num_tokens": int(mask.sum()),
              **agent_parity(engine, actor, tok)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()


def agent_parity(engine, actor, tok) -> dict:
    """Multi-turn episodes of the embedded guessing game: the actor's log-probs of the model's tokens (the
    environment's hint tokens sit between the turns) equal the engine's."""
    agent = load_agent(os.path.join(TINY_DIR, "guess_agent.py"))
    texts, labels = ["e m :", "r :", "s b :"], ["0", "1", "8"]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    spec = SamplingSpec(n=4, temperature=1.0, top_p=1.0, max_tokens=0)
    gens, _ = run_episodes(engine, agent, tok, prompt_ids, texts, labels, spec, [11, 12, 13],
                           TurnLimits(max_total=24, max_turns=2, turn_max_tokens=4))
    rollout = to_rollout(prompt_ids, gens, tok.pad_token_id, tok, texts, labels)
    mask = rollout.action_mask_BT1
    actor_lp = actor.logprobs(rollout.sequences_BT, rollout.attention_mask_BT)
    spans = (torch.diff(mask, dim=1, prepend=torch.zeros(mask.shape[0], 1)) > 0).sum(1)
    return {"agent_max_abs_diff": float(((actor_lp - rollout.rollout_logprobs_BT1).abs() * mask).max()),
            "agent_num_tokens": int(mask.sum()), "agent_multi_span_rows": int((spans >= 2).sum()),
            "agent_env_tokens": int((rollout.attention_mask_BT[:, 1:].float() * (1 - mask)).sum()
                                    - (rollout.prompt_lens_B - 1).sum())}


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
