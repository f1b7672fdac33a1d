"""Multi-turn agents through `train_ppo` (2 ranks, critic and reference): packed + dynamic batches + ring attention
== padded on agent trajectories, and the rollout log-probs the trainer compares against stay at float precision."""


import pytest


def _agent_ppo(out, *extra: str) -> tuple[str, list[str]]:
    from rlhf.assets import TINY_DIR
    from tests.tiny_runs import EAGER, TRAIN

    return "train_ppo", [*TRAIN, *EAGER, "--agent_func_path", f"{TINY_DIR}/guess_agent.py",
                         "--prompt_data", f"{TINY_DIR}/guess_prompts.jsonl", "--input_key", "input",
                         "--label_key", "label", "--agent_max_turns", "2", "--agent_turn_max_tokens", "4",
                         "--generate_max_len", "8", "--prompt_max_len", "8", "--rollout_batch_size", "4",
                         "--n_samples_per_prompt", "4", "--train_batch_size", "16", "--micro_train_batch_size", "2",
                         "--micro_rollout_batch_size", "4", "--advantage_estimator", "gae", "--init_kl_coef", "0.05",
                         "--actor_learning_rate", "1e-3", "--max_steps", "2", "--save_path", str(out), *extra]


@pytest.mark.vllm
def test_agent_ppo_packed_dynamic_ring_matches_padded(tmp_path):
    """PPO (critic, reference, KL in the reward) on agent episodes: the first step with packed samples,
    dynamic micro-batches and ring attention over 2 ranks equals the padded one, and the trainer's
    log-probs of the model's tokens equal the engine's."""
    from tests.distributed import run_job_variants
    from tests.tiny_runs import read_metrics

    pytest.importorskip("vllm")
    run_job_variants(2, [
        _agent_ppo(tmp_path / "padded"),
        _agent_ppo(tmp_path / "ring", "--packing_samples", "--use_dynamic_batch", "--ring_attn_size", "2",
                   "--train_max_tokens_per_gpu", "16", "--rollout_max_tokens_per_gpu", "24"),
    ], tmp_path / "consoles", tmp_path / "padded", tmp_path / "ring")
    padded, ring = read_metrics(tmp_path / "padded"), read_metrics(tmp_path / "ring")
    first, expected = ring[0], padded[0]
    assert expected["reward_extra/agent_turns"] > 1.5  # most episodes took both turns: several action spans
    assert expected["rollout/logprob_abs_diff"] < 1e-5 and expected["value_loss"] > 0
    for key in ("reward_mean", "kl", "return_mean", "advantage_mean", "policy_loss", "value_loss", "clip_frac",
                "grad_norm", "critic_grad_norm", "response_length", "reward_extra/agent_turns"):
        assert first[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5), key
