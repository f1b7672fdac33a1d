"""--dynamic_filtering's learning run behind the README's figure: the quickstart's settings for 40 steps on 2 ranks,
with and without the refill, compared by held-out pass1."""


from tests.distributed import run_job_variants


def test_refilled_batches_learn_faster_per_step(tmp_path):
    """The quickstart's settings for 40 steps on 2 ranks, with and without --dynamic_filtering: early on most
    groups score 0 everywhere and teach nothing; refilled batches hold only informative groups. The held-out
    pass1 (--eval_dataset, 64 prompts x 4 samples) after 40 steps is far higher with the refill."""
    import json

    from rlhf.assets import TINY_DIR

    rows = [line for line in open(f"{TINY_DIR}/prompts.jsonl")][64:128]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(rows))
    settings = ["--param_dtype", "fp32", "--attn_implementation", "sdpa", "--advantage_estimator", "group_norm",
                "--init_kl_coef", "0", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16",
                "--micro_rollout_batch_size", "64", "--train_batch_size", "64", "--micro_train_batch_size", "32",
                "--generate_max_len", "8", "--prompt_max_len", "16", "--label_key", "label",
                "--actor_learning_rate", "3e-3", "--lr_warmup_ratio", "0.05", "--num_episodes", "8",
                "--max_steps", "40", "--zero_stage", "2", "--seed", "1", "--eval_dataset", str(eval_file),
                "--eval_steps", "10", "--eval_n_samples_per_prompt", "4", "--eval_temperature", "1.0"]

    # both runs in the same two rank processes (`run_job_variants`: one process start)
    run_job_variants(2, [("train_ppo", [*settings, "--save_path", str(tmp_path / "off")]),
                         ("train_ppo", [*settings, "--save_path", str(tmp_path / "on"), "--dynamic_filtering",
                                        "--dynamic_filtering_max_rounds", "20"])],
                     tmp_path / "consoles", tmp_path / "off", tmp_path / "on")

    def pass1(name):
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        return {r["step"]: r["eval/default_pass1"] for r in metrics if "eval/default_pass1" in r}, metrics

    off, _ = pass1("off")
    on, on_rows = pass1("on")
    print(f"held-out pass1 by step: without refill {off}, with refill {on}")
    assert off[0] == on[0]  # the same initial model
    assert on[40] > 1.5 * off[40] and on[40] > off[0] + 0.1
    assert all(r["kept_ratio"] == 1.0 for r in on_rows if r["step"] > 0)
