"""Run on the ranks of `tests.distributed.run_on_ranks` (or under torchrun): the PPO trainer's `generate` (its
per-prompt seeds, its engine slicing) for two steps of a batch that repeats prompts, gathered in global order; with one
rank per engine also batches of 1 and 3 prompts (fewer prompts than engines, unequal shares); with a single engine also
many one-token samples of one prompt, as separate requests (n = 1) and as the n samples of one request. Rank 0 writes a
JSON report.

    torchrun --nproc_per_node WORLD tests/workers/rollout_seeds.py OUT.json TP TEMPERATURE
"""

import json
import sys

import torch.distributed as dist

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.core.run import for_this_machine
from rlhf.data.prompts import Prompt, PromptSampler
from rlhf.distributed.collectives import all_gather_rollout
from rlhf.distributed.launch_env import init_distributed, read_launch_env
from rlhf.distributed.topology import Topology, plan_ranks
from rlhf.engines.rollout import SamplingSpec, request_seed
from rlhf.models.loading import load_tokenizer
from rlhf.trainers.ppo_build import placement_from_config
from rlhf.trainers.ppo_run import build_rollout_engine
from rlhf.trainers.ppo_trainer import PPOTrainer

# the same prompt in several rows of one step's batch (and on different engines with 2 engines)
BATCH_TEXTS = [":", "a b copy 7 :", ":", "x copy 1 :", ":", "a b copy 7 :", "copy 3 :", ":"]
STEPS = (0, 5)
STAT_PROMPT = ":"
NUM_STAT_REQUESTS = 600
NUM_CHILD_REQUESTS = 100
NUM_CHILDREN = 4


def main(out_path: str, tp: int, temperature: float) -> None:
    launch = read_launch_env()
    cfg = parse_config(TrainPPOConfig, [
        "--param_dtype", "fp32", "--rollout_batch_size", "8",
        "--n_samples_per_prompt", "4", "--train_batch_size", "8", "--micro_train_batch_size", "2",
        "--generate_max_len", "6", "--prompt_max_len", "16",
        "--temperature", str(temperature), "--seed", "7", "--vllm_tensor_parallel_size", str(tp),
        "--rollout_engine", "vllm", "--enforce_eager"])
    cfg = for_this_machine(cfg.with_demo_defaults())  # the embedded tiny policy, as train_ppo does
    cfg.check_world(launch.world_size)
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    ids = {t: tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in {*BATCH_TEXTS, STAT_PROMPT}}
    sampler = PromptSampler([Prompt(t, ids[t], None) for t in BATCH_TEXTS], cfg.batch.rollout_batch_size, cfg.seed)
    device = init_distributed(launch)
    topology = Topology(plan_ranks(placement_from_config(cfg), launch.world_size), rollout_tp=tp)
    engine = build_rollout_engine(cfg.rollout, cfg.model, device, tok, seed=cfg.seed, max_model_len=cfg.max_model_len)
    trainer = PPOTrainer(cfg, topology, None, engine, sampler, tok, device)
    report: dict = {"steps": {}}
    for step in STEPS:
        r = all_gather_rollout(trainer.generate(step), tok.pad_token_id)
        responses = [r.sequences_BT[b, p:p + n].tolist()
                     for b, (p, n) in enumerate(zip(r.prompt_lens_B.tolist(), r.response_lens_B.tolist()))]
        report["steps"][step] = {"prompts": r.prompts, "responses": responses, "finish_reasons": r.finish_reasons,
                                 "batch": [p.text for p in sampler.batch(step)]}
    if tp == 1:
        report["uneven"] = {}
        for n in (1, 3):
            r = all_gather_rollout(trainer.generate(STEPS[0], batch=sampler.batch(STEPS[0])[:n]), tok.pad_token_id)
            report["uneven"][n] = {"prompts": r.prompts, "responses": r.sequences_BT.tolist()}
    if topology.num_engines == 1:
        one_token = SamplingSpec(n=1, temperature=temperature, top_p=1.0, max_tokens=1)
        seeds = [request_seed(cfg.seed, 0, i) for i in range(NUM_STAT_REQUESTS)]
        gens = engine.generate([list(ids[STAT_PROMPT])] * NUM_STAT_REQUESTS, one_token, seeds)
        report["first_tokens"] = [g[0].token_ids[0] for g in gens]
        children = SamplingSpec(n=NUM_CHILDREN, temperature=temperature, top_p=1.0, max_tokens=1)
        gens = engine.generate([list(ids[STAT_PROMPT])] * NUM_CHILD_REQUESTS, children, seeds[:NUM_CHILD_REQUESTS])
        report["child_first_tokens"] = [[g.token_ids[0] for g in per_prompt] for per_prompt in gens]
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
