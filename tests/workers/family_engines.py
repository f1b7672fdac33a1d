"""Run on one rank (`tests.distributed.run_on_ranks`, or torchrun): for each named family of the tiny zoo, start a vLLM
engine on its random weights, move the actor's weights (one AdamW step on a synthetic loss), push them into the engine,
sample chat prompts, and compare the engine's log-probs with the actor's (padded and packed forwards). Writes a JSON
report {family: {...}}.

    torchrun --nproc_per_node 1 tests/workers/family_engines.py OUT.json ZOO_DIR FAMILY [FAMILY ...]
"""

import gc
import json
import os
import sys

import torch

from rlhf.distributed.launch_env import init_distributed, read_launch_env
from rlhf.engines.rollout import SamplingSpec, to_rollout
from rlhf.engines.vllm_engine import VLLMEngine
from rlhf.models.layout import PADDED, SequenceLayout
from rlhf.models.lm_logprobs import policy_forward
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.zoo import build_family, family

PROMPTS = ["copy 3", "please copy the digit 7", "Hello, how are you?"]


def moved_actor(path: str):
    """The family's model after one AdamW step on the log-likelihood of a fixed random sequence."""
    torch.manual_seed(1)
    layout = PADDED
    model = load_causal_lm(path, torch.float32, layout.attn_implementation("sdpa"))
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    mask = torch.ones_like(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    loss = -policy_forward(model, ids, mask, layout=layout).logprobs_BT1.mean()
    loss.backward()
    optimizer.step()
    model.eval()
    return model


def check_family(name: str, zoo_dir: str) -> dict:
    path = build_family(name, os.path.join(zoo_dir, name))
    fam = family(name)
    tok = load_tokenizer(path)
    engine = VLLMEngine(path, dtype=torch.float32, tp_size=1, seed=0, max_model_len=128, kv_cache_bytes=16 << 20,
                        gpu_memory_utilization=0.5, enforce_eager=True, enable_prefix_caching=False,
                        enable_sleep=False)
    actors = {"padded": moved_actor(path)}
    actors["packed"] = load_causal_lm(path, torch.float32, SequenceLayout(packing=True).attn_implementation("sdpa"))
    actors["packed"].load_state_dict(actors["padded"].state_dict())
    engine.load_weights((n, p.detach()) for n, p in actors["padded"].named_parameters())
    texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in PROMPTS]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    gens = engine.generate(prompt_ids, SamplingSpec(n=8, temperature=1.0, top_p=1.0, max_tokens=48), [5, 6, 7])
    rollout = to_rollout(prompt_ids, gens, tok.pad_token_id, tok, texts, [None] * len(texts))
    mask = rollout.action_mask_BT1
    report = {"num_tokens": int(mask.sum())}
    with torch.no_grad():
        for layout_name, layout in (("padded", PADDED), ("packed", SequenceLayout(packing=True))):
            lp = policy_forward(actors[layout_name], rollout.sequences_BT, rollout.attention_mask_BT,
                                layout=layout).logprobs_BT1
            report[f"{layout_name}_max_abs_diff"] = float(((lp - rollout.rollout_logprobs_BT1).abs() * mask).max())
        initial = load_causal_lm(path, torch.float32, "sdpa")
        lp0 = policy_forward(initial, rollout.sequences_BT, rollout.attention_mask_BT).logprobs_BT1
        report["diff_vs_initial_weights"] = float(((lp0 - rollout.rollout_logprobs_BT1).abs() * mask).max())
    stop_ids = {tok.convert_tokens_to_ids(t) for t in fam.generation_eos}
    stopped = [g.token_ids for per_prompt in gens for g in per_prompt if g.finish_reason == "stop"]
    report["stopped"] = len(stopped)
    report["stopped_on_stop_token"] = sum(ids[-1] in stop_ids for ids in stopped)
    report["stopped_on_turn_end"] = sum(ids[-1] == tok.convert_tokens_to_ids(fam.turn_end) for ids in stopped)
    report["stop_token_inside"] = sum(any(t in stop_ids for t in g.token_ids[:-1])
                                      for per_prompt in gens for g in per_prompt)
    engine.llm.llm_engine.engine_core.shutdown()
    del engine, actors
    gc.collect()
    return report


def main(out_path: str, zoo_dir: str, names: list[str]) -> None:
    init_distributed(read_launch_env())
    report = {name: check_family(name, zoo_dir) for name in names}
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
