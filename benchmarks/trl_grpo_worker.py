"""One rank of TRL's `GRPOTrainer` for `trl_compare.py` (run under torchrun, in a Python that has `trl`):

    torchrun --nproc_per_node 2 benchmarks/trl_grpo_worker.py MODEL_DIR PROMPTS_JSONL STEPS OUT_JSON

The comparison's settings (trl_compare.py's docstring): 8 prompts x 4 samples a step over the ranks, up to 128 new
tokens, temperature 1, top-p 1, no KL term, fp32 on CPU, HF generate. Rank 0 writes each step's end time
(`time.perf_counter()`) to OUT_JSON."""

from __future__ import annotations

import json
import sys
import tempfile
import time


def copy_reward(prompts, completions, label, **kwargs) -> list[float]:
    """The embedded demo's reward (rlhf/assets/tiny/reward.py): the fraction of the first four words equal to
    the label."""
    return [sum(w == str(lab) for w in text.split()[:4]) / 4.0 for text, lab in zip(completions, label)]


def main(model_dir: str, prompts_path: str, steps: int, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(prompts_path)]
    data = Dataset.from_list([{"prompt": r["input"], "label": str(r["label"])} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=16, num_generations=4,
                            max_completion_length=128, temperature=1.0, top_p=1.0, beta=0.0, learning_rate=1e-6,
                            max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                            bf16=False, seed=0, disable_dropout=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=copy_reward, args=config, train_dataset=data,
                              processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()
        if trainer.accelerator.is_main_process:
            key = "completions/mean_length"
            lengths = [r[key] for r in trainer.state.log_history if key in r]
            with open(out_path, "w") as f:
                json.dump({"step_ends": ends, "mean_completion_length": lengths}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
