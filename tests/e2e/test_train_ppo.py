"""End-to-end runs of `train_ppo` on the embedded tiny demo, through torchrun."""

import os

import pytest
import torch

from tests.distributed import run_job_variants
from tests.tiny_runs import SMALL, read_metrics

REQUIRED_KEYS = {"step", "reward_mean", "time/generation", "time/weight_sync", "time/experience", "time/train",
                 "time/step", "policy_loss", "grad_norm", "lr", "response_length"}
SAMPLES_PER_STEP = 16  # SMALL: 4 prompts x 4 samples


def check_outputs(out_dir, steps):
    """The metrics of every step, after checking values that follow from the setup: each sample's copy-task
    reward is a multiple of 1/4 (the share of its first four words equal to the digit), so a step's mean is a
    multiple of 1 / (4 x 16); and the saved model is the trained one (it differs from the initial weights)."""
    from safetensors.torch import load_file

    from rlhf.assets import EMBEDDED_MODEL_DIR

    rows = read_metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert REQUIRED_KEYS <= set(row), REQUIRED_KEYS - set(row)
        quarters = row["reward_mean"] * 4 * SAMPLES_PER_STEP
        assert abs(quarters - round(quarters)) < 1e-6 and 0 <= quarters <= 4 * SAMPLES_PER_STEP, row["reward_mean"]
        # the stages account for rank 0's step: its waits for a slower rank fall in the stage they end (when they
        # did not, 0.37 s of a 1.4 s step was in none). What is left between the stages is a few lines of Python,
        # where a loaded machine can still take the CPU away from the rank for a scheduler period or two (14.5 ms
        # of a 0.6 s step seen with the profiler beside the two test workers)
        stages = sum(v for k, v in row.items() if k.startswith("time/") and k != "time/step")
        assert -1e-6 <= row["time/step"] - stages <= 0.03 + 0.02 * row["time/step"], row
    assert not os.path.exists(out_dir / "plots")  # --no_plots (SMALL's)
    before = load_file(os.path.join(EMBEDDED_MODEL_DIR, "model.safetensors"))
    after = load_file(os.path.join(out_dir, "model", "model.safetensors"))
    assert after.keys() == before.keys()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4
    return rows


def _two_rank_vllm_runs(tmp) -> dict[str, tuple[str, list[str]]]:
    """The 2-rank vLLM runs of this file: name -> (module, argv)."""
    from rlhf.assets import TINY_DIR

    return {
        "stabilisers": ("train_ppo", [
            *SMALL, "--train_batch_size", "16", "--advantage_estimator", "rloo", "--use_kl_loss", "--kl_estimator",
            "k3", "--init_kl_coef", "0.01", "--policy_loss_type", "gspo", "--entropy_loss_coef", "0.01",
            "--ptx_coef", "0.1", "--pretrain_data", f"{TINY_DIR}/prompts.jsonl", "--enable_vllm_is_correction",
            "--use_icepop", "--dynamic_filtering", "--dynamic_filtering_reward_range", "-0.01", "0.99",
            "--overlong_buffer_len", "2", "--stop_properly_penalty_coef", "0.5", "--normalize_reward",
            "--reward_clip_range", "-2", "2", "--save_path", str(tmp / "stabilisers")]),
        "critic_warmup": ("train_ppo", [
            *SMALL, "--advantage_estimator", "gae", "--n_samples_per_prompt", "1", "--rollout_batch_size", "8",
            "--reward_pretrain", f"{TINY_DIR}/reward_model", "--freezing_actor_steps", "2", "--value_clip", "0.2",
            "--dual_clip", "3", "--init_kl_coef", "0.05", "--kl_target", "0.001", "--kl_horizon", "100",
            "--save_path", str(tmp / "critic_warmup")]),
        "zero3": ("train_ppo", [  # last: ZeRO-3's hooks stay installed in the process (tests.tiny_runs.run_jobs)
            *SMALL, "--zero_stage", "3", "--advantage_estimator", "reinforce_baseline",
            "--save_path", str(tmp / "zero3"), "--use_tensorboard", str(tmp / "tb")]),
    }


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The output directories of `_two_rank_vllm_runs`, in two 2-rank launches (`run_job_variants`):
    a third vLLM engine built in one process hung in its gloo group's rendezvous, so at most two per launch."""
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("two_rank")
    runs = _two_rank_vllm_runs(tmp)
    for names in (["stabilisers"], ["critic_warmup", "zero3"]):
        run_job_variants(2, [runs[name] for name in names], tmp / f"consoles-{names[0]}",
                         *(tmp / name for name in names))
    return tmp


@pytest.mark.vllm
def test_two_rank_vllm_zero3_reinforce_baseline(two_rank_runs):
    rows = check_outputs(two_rank_runs / "zero3", 3)  # the saved model was gathered from ZeRO-3 shards
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(two_rank_runs / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("reward_mean")] == pytest.approx([r["reward_mean"] for r in rows])


def test_hf_fallback_engine_single_rank(tmp_path):
    """--vllm_num_engines 0 (OpenRLHF: no vLLM) generates with transformers, as the algorithm line says."""
    out = tmp_path / "run"
    log, = run_job_variants(1, [("train_ppo", [*SMALL, "--vllm_num_engines", "0", "--save_path", str(out),
                                               "--zero_stage", "0"])], tmp_path / "consoles", out)
    assert ", generation: transformers generate (--vllm_num_engines 0)\n" in log
    check_outputs(out, 3)


def _initial_ptx_loss(world_size: int, draws_per_rank: int, micro: int, max_len: int) -> float:
    """The ptx loss of the first optimizer step computed here: the initial policy's mean next-token NLL over
    the pretraining micro-batches each rank draws first (the prompts file's `input` texts), averaged over
    every micro-batch of the step."""
    from rlhf.assets import EMBEDDED_MODEL_DIR, TINY_DIR
    from rlhf.config.ppo_config import TrainPPOConfig
    from rlhf.data.pretrain import PtxData, tokenize_texts
    from rlhf.data.prompts import load_texts
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    cfg = TrainPPOConfig()
    texts = load_texts(f"{TINY_DIR}/prompts.jsonl", "input", cfg.data.max_samples)
    batches = tokenize_texts(texts, load_tokenizer(EMBEDDED_MODEL_DIR), micro, max_len, "prompts")
    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").eval()
    losses = []
    for rank in range(world_size):
        data = PtxData(batches, world_size, rank, cfg.seed)
        for _ in range(draws_per_rank):
            ids, mask = data.next()
            with torch.no_grad():
                logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
            target = mask[:, 1:].float()
            nll = -(logprobs.gather(-1, ids[:, 1:, None])[..., 0] * target).sum() / target.sum()
            losses.append(float(nll))
    return sum(losses) / len(losses)


@pytest.mark.vllm
def test_every_stabiliser_wired_through(two_rank_runs):
    """RLOO + GSPO with KL loss, entropy bonus, ptx loss, ICEPOP correction, dynamic filtering, length
    penalties, reward normalisation and clipping run together; one optimizer step per RL step (16 samples),
    so step 1's terms are those of the initial policy: the ptx loss equals the SFT loss of the batches drawn
    (computed here), the KL to the reference is exactly 0, the engine's and the actor's log-probs agree, so
    every importance weight is 1; the shaped rewards stay inside the clip range."""
    rows = check_outputs(two_rank_runs / "stabilisers", 3)
    first = rows[0]
    # 16 samples over 2 ranks in micro-batches of 2: 4 ptx draws per rank; texts cut at 16 + 6 tokens
    assert first["ptx_loss"] == pytest.approx(_initial_ptx_loss(2, 4, 2, 22), rel=1e-5)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7) and first["train_kl"] == pytest.approx(0.0, abs=1e-7)
    assert first["rollout/logprob_abs_diff"] < 1e-5 and first["rollout/is_weight_mean"] == pytest.approx(1.0)
    assert first["rollout/is_clipped_frac"] == 0.0
    assert all(-2.0 <= row["reward_shaped_mean"] <= 2.0 for row in rows)
    assert rows[-1]["kl"] > 0 and rows[-1]["train_kl"] > 0  # the policy moved away from the reference


@pytest.mark.vllm
def test_critic_warmup_freezes_the_actor_and_adaptive_kl_moves(two_rank_runs):
    out = two_rank_runs / "critic_warmup"
    rows = read_metrics(out)
    assert [("policy_loss" in r) for r in rows] == [False, False, True]
    assert all(r["value_loss"] > 0 for r in rows)
    assert rows[0]["kl_coef"] == 0.05 and rows[2]["kl_coef"] != rows[1]["kl_coef"]
    assert os.path.isfile(out / "critic" / "model.safetensors")
