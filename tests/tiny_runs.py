"""Flags and readers shared by the tests that run the jobs on the embedded tiny demo."""

import json
import os

CPU = ["--param_dtype", "fp32", "--attn_implementation", "sdpa"]
"""What the tests run in (the defaults are OpenRLHF's: bf16 and flash-attn)."""
SMALL = [*CPU, "--init_kl_coef", "0", "--advantage_estimator", "group_norm",
         "--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--train_batch_size", "8",
         "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "6",
         "--prompt_max_len", "16", "--label_key", "label", "--actor_learning_rate", "1e-3", "--max_steps", "3"]


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
