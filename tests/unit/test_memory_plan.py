"""The memory plan's terms against hand-derived numbers, its report's verdicts and suggestions, the measured
peaks' bookkeeping, and `--dry_run` finishing without loading a weight."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.core.throughput import MemoryPeaks
from rlhf.distributed.topology import Role, plan_ranks
from rlhf.planning import peak_memory as mp
from rlhf.planning.job_memory import job_memory
from rlhf.planning.model_shapes import ModelShape, read_shape, shape_path
from rlhf.planning.report import fitting_changes, peak, report
from rlhf.trainers.ppo_build import placement_from_config
from rlhf.utils import watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
SMALL = ModelShape(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=256, vocab=100)


def test_shapes_count_the_public_parameter_numbers():
    # Qwen2.5-7B: 7.62B (q/k/v biases, untied); Llama-3-70B: 70.55B
    assert read_shape(shape_path("qwen2.5-7b")).params() == 7_615_616_512
    assert read_shape(shape_path("llama-3-70b")).params() == 70_553_706_496


def test_shape_of_the_embedded_model_counts_its_parameters():
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf.assets import EMBEDDED_MODEL_DIR

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR))
    assert read_shape(EMBEDDED_MODEL_DIR).params() == sum(p.numel() for p in model.parameters())


def test_small_shape_by_hand():
    # block: q, o 64x64 each; k, v 64x32 each; MLP 3 x 64x256; two norms of 64
    block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 256 + 2 * 64
    assert SMALL.layer_params == block
    assert SMALL.params() == 100 * 64 + 2 * block + 64 + 100 * 64
    assert SMALL.params(scalar_head=True) == 100 * 64 + 2 * block + 64 + 64
    lora = mp.Model(SMALL, trained=True, lora_rank=4)
    assert lora.trainable_params == 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 256) + (256 + 64))


@pytest.mark.parametrize("stage, dtype, n, offload, grads, optim", [
    (0, 4, 2, False, 4e6, 8e6),  # fp32 without ZeRO: gradients, two moments, no master copy
    (0, 2, 2, False, 2e6, 12e6),  # bf16 without ZeRO: an fp32 master copy too
    (1, 4, 2, False, 4e6, 6e6),  # ZeRO-1: optimizer states (with the master copy DeepSpeed clones) over 2
    (2, 2, 4, False, 2e6 + 1e6, 3e6),  # ZeRO-2: the reduce bucket holds every gradient + the fp32 partition
    (3, 2, 4, False, 2e6 + 0.5e6 + 1e6, 3e6),  # ZeRO-3: the bucket, the 16-bit gradient shard, the fp32 partition
    (3, 2, 4, True, 2e6 + 0.5e6, 0),  # --adam_offload: fp32 partitions and states on the host
])
def test_gradients_and_optimizer_states_by_zero_stage(stage, dtype, n, offload, grads, optim):
    t = mp.Training(dtype_bytes=dtype, zero_stage=stage, adam_offload=offload)
    assert mp.gradient_bytes(10**6, n, t) == grads
    assert mp.optimizer_bytes(10**6, n, t) == optim


def test_cuda_counts_deepspeeds_whole_reduce_buckets():
    """On CUDA DeepSpeed's 5e8-element reduce bucket counts whole (1e6 parameters, bf16, 4 ranks)."""
    def cuda(stage, **kw):
        return mp.Training(dtype_bytes=2, zero_stage=stage, cuda=True, **kw)

    bucket = 5e8 * 2
    assert mp.gradient_bytes(10**6, 4, cuda(2)) == bucket + 1e6  # + the fp32 partition
    assert mp.gradient_bytes(10**6, 4, cuda(2, overlap_comm=True)) == 2 * bucket + 1e6  # double-buffered
    assert mp.gradient_bytes(10**6, 4, cuda(1, accum_bytes=4)) == 2e6 + 5e8 * 4  # ZeRO-1 stages in fp32
    # ZeRO-3: the bucket and the gradient shard are the optimizer's from start-up, in every stage but asleep
    assert mp.gradient_bytes(10**6, 4, cuda(3)) == 1e6  # the step's fp32 copy of the shard
    actor = mp.Model(SMALL, trained=True, offload=True)
    gathered = int(min(SMALL.params(), mp.ZERO3_LIVE_ELEMENTS) * 2)
    awake = mp.resident(actor, 4, cuda(3), active=True)["buffers"]
    assert awake == gathered + bucket + 2 * SMALL.params() // 4  # + the bf16 gradient shard
    assert mp.resident(actor, 4, cuda(3), active=False)["buffers"] == gathered  # offloaded by the sleep


def test_activations_shrink_with_checkpointing_and_ring():
    t = mp.Training(dtype_bytes=2, zero_stage=2)
    per_token = mp.block_bytes_per_token(SMALL, 2)
    assert per_token == 2 * 10 * 64 + 2 * (3 * 64 + 2 * 32) + 4 * 2 * 256
    full = mp.activation_bytes(SMALL, 1000, 500, True, t)
    assert full == 2 * per_token * 1000 + 1000 * 64 * 2 * 2
    ckpt = mp.activation_bytes(SMALL, 1000, 500, True, mp.Training(dtype_bytes=2, zero_stage=2,
                                                                      gradient_checkpointing=True))
    assert ckpt == 2 * 1000 * 64 * 2 + 2 * per_token * 1000 + 1000 * 64 * 2 * 2
    model = mp.Model(SMALL, trained=True)
    ring = mp.pass_bytes(model, mp.Pass("actor", 1000, 500, True), 2, mp.Training(dtype_bytes=2, zero_stage=2,
                                                                                    ring_size=2))
    assert ring["activations"] == mp.activation_bytes(SMALL, 500, 500, True, t)
    assert ring["logits"] == 500 * 100 * 2 * 2


def test_tensor_parallel_splits_each_ranks_weights_and_states():
    """--ds_tensor_parallel_size 2 on 4 ranks at ZeRO-1 in bf16: each rank holds half of every parameter, and the
    optimizer states of that half partitioned over its 2-rank data group; the rank plan names the groups."""
    cfg, plan, job = ppo_job(4, "--zero_stage", "1", "--ds_tensor_parallel_size", "2")
    assert job.training.tp_size == 2
    actor = job.models["actor"]
    train = mp.stage_breakdown(job, 0, "train")
    half = actor.params // 2
    resident = mp.resident(mp.replace(actor, tp_split=2), 2, job.training, True)
    assert resident["weights"] == half * 2 and resident["optimizer"] == 12 * half // 2
    whole = mp.stage_breakdown(ppo_job(4, "--zero_stage", "1")[2], 0, "train")
    # ZeRO-1 over 4 ranks and over 2 ranks of half the parameters partition the same bytes; the weights halve
    assert train["optimizer"] == whole["optimizer"] and train["weights"] * 2 == whole["weights"]
    assert "  actor: ranks 0-3, 2 data-parallel replica(s), tensor-parallel groups of 2" in report(cfg, job, plan, 4)


def test_vllm_takes_its_fraction_on_cuda_and_sleeps():
    rollout = mp.Rollout(SMALL, vllm=True, tp=1, gpu_fraction=0.5, sleep=True)
    device = 1000 * MiB
    gen = mp.rollout_bytes(rollout, 2, "generation", device)
    assert gen["rollout_weights"] + gen["kv_cache"] == 500 * MiB
    assert mp.rollout_bytes(rollout, 2, "train", device) == {}
    cpu = mp.rollout_bytes(mp.Rollout(SMALL, vllm=True, tp=2, kv_cache_bytes=64 * MiB), 2, "train", None)
    assert cpu == {"rollout_weights": SMALL.params() * 2 // 2, "kv_cache": 64 * MiB}


def ppo_job(world: int, *flags: str):
    argv = ["--pretrain", shape_path("qwen2.5-7b"), "--colocate_all_models", "--param_dtype", "bf16",
            "--vllm_tensor_parallel_size", "2", "--rollout_engine", "vllm", "--gpu_memory_gb", "80",
            "--prompt_data", "prompts.jsonl", "--reward_pretrain", shape_path("qwen2.5-7b"), *flags]
    cfg = parse_config(TrainPPOConfig, argv)
    plan = plan_ranks(placement_from_config(cfg), world)
    return cfg, plan, job_memory(cfg, plan)


def test_a_7b_ppo_at_zero0_does_not_fit_and_the_plan_says_what_would():
    cfg, plan, job = ppo_job(8, "--zero_stage", "0")
    top, _, _ = peak(job, 8)
    # actor and critic whole, each with bf16 weights and 12 bytes/param of Adam: far over 80 GiB
    assert top > 2 * 7.6e9 * (2 + 12)
    text = report(cfg, job, plan, 8)
    assert "does not fit" in text
    assert "rollout: 4 engine(s) of tensor-parallel size 2 (ranks 0-1; 2-3; 4-5; 6-7)" in text
    fixes = fitting_changes(cfg, job, 8, 80 << 30)
    assert fixes and all("--zero_stage 3" in f for f in fixes)


def test_repulse_plans_its_proposal_as_a_second_trained_policy():
    """RePULSe's --dry_run plans the proposal q: a trained copy of the policy on the actor's ranks. With
    --use_base_as_proposal there is no q, and the train stage holds half the trained weights and optimizer states
    (gradients are a training pass's, one model at a time)."""
    from rlhf.repulse.repulse_config import TrainRepulseConfig

    repulse = ["--do_harmlessness_training", "--harmlessness_training_loss_type", "neg_training",
               "--reinforce_baseline_type", "expectation", "--actor_loss_type", "ctl",
               "--parameterization", "policy_psi_q_p_s_t", "--target_dist_beta", "-1", "--alpha", "1",
               "--duplicate_rollout_batch_by", "4", "--zero_stage", "3"]
    argv = ["--pretrain", shape_path("qwen2.5-7b"), "--colocate_all_models", "--param_dtype", "bf16",
            "--rollout_engine", "vllm", "--gpu_memory_gb", "80", "--prompt_data", "prompts.jsonl",
            "--reward_pretrain", shape_path("qwen2.5-7b"), *repulse]
    jobs = {}
    for name, extra in (("q", []), ("base", ["--use_base_as_proposal"])):
        cfg = parse_config(TrainRepulseConfig, [*argv, *extra])
        plan = plan_ranks(placement_from_config(cfg), 8)
        jobs[name] = job_memory(cfg, plan)
    q, base = jobs["q"], jobs["base"]
    assert q.models["proposal"] == q.models["actor"] and q.models["proposal"].trained
    assert q.ranks["proposal"] == q.ranks["actor"] == tuple(range(8))
    assert "proposal" not in base.models and "critic" not in q.models
    train_q, train_base = mp.estimate(q, 8)[0]["train"], mp.estimate(base, 8)[0]["train"]
    for part in ("weights", "optimizer"):  # the actor's and q's, sharded alike
        assert train_q[part] == 2 * train_base[part] > 0
    assert train_q["gradients"] == train_base["gradients"] > 0  # one model's training pass at a time


def test_a_7b_ppo_at_zero3_with_sleep_fits_on_80_gb():
    cfg, plan, job = ppo_job(8, "--zero_stage", "3", "--vllm_enable_sleep", "--deepspeed_enable_sleep",
                             "--vllm_gpu_memory_utilization", "0.5", "--gradient_checkpointing")
    text = report(cfg, job, plan, 8)
    assert "fits: peak" in text, text
    est = mp.estimate(job, 8)
    assert est[0]["generation"]["gradients"] == 0 and est[0]["train"]["kv_cache"] == 0  # offloaded / asleep


def test_memory_peaks_file_each_stage_apart():
    peaks = MemoryPeaks(torch.device("cpu"), {"train": 123})
    try:
        def stage(name: str, mib: int) -> None:
            watchdog.enter(name)
            x = torch.ones(mib * MiB // 4)  # touched: resident
            time.sleep(0.1)
            del x
            watchdog.leave()
            time.sleep(0.05)

        watchdog.enter("step")
        stage("experience", 200)
        stage("train", 40)
        watchdog.leave()
        peaks.file()
        table = peaks.table()
    finally:
        peaks.stop()
    assert 190 * MiB < table["experience"]["measured"] < 260 * MiB
    assert 35 * MiB < table["train"]["measured"] < 100 * MiB  # the experience stage's 200 MiB are not charged here
    assert table["train"]["estimated"] == 123


REFUSE_WEIGHTS = """
import sys, torch.distributed as dist, transformers, safetensors.torch
def refuse(*a, **k): raise SystemExit('loaded weights or started a process group')
transformers.PreTrainedModel.from_pretrained = classmethod(refuse)
safetensors.torch.load_file = refuse
dist.init_process_group = refuse
from rlhf.cli.train_ppo import main
for argv in ARGVS:
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code in (0, None), exit.code
"""
"""Runs train_ppo with each of ARGVS in one process; any weight load or process group fails it."""


def test_dry_run_of_the_seed_commands_prints_plans_without_loading_weights(tmp_path):
    from tests.openrlhf_commands import DAPO, PPO_HYBRID_ENGINE, PPO_WITH_REWARD_FN, at_tiny_scale

    argvs = []
    for i, command in enumerate((PPO_HYBRID_ENGINE, PPO_WITH_REWARD_FN, DAPO)):
        (tmp_path / str(i)).mkdir()
        argvs.append([*at_tiny_scale(command, tmp_path / str(i)), "--dry_run", "--gpu_memory_gb", "80"])
    # rank 0 of a 2-rank launch, planned from this one process (a dry run starts no process group)
    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    proc = subprocess.run([sys.executable, "-c", f"ARGVS = {argvs!r}\n{REFUSE_WEIGHTS}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = proc.stdout.split("rank plan (2 ranks):")[1:]
    assert len(plans) == 3, proc.stdout
    assert all("fits: peak" in plan for plan in plans), proc.stdout
    # OpenRLHF's Ray placement of the same flags beside ours (at tiny scale: 1 GPU per role)
    assert "  1 GPU: actor + reference + critic + reward + 4 vLLM engine(s) of TP 1" in plans[0], plans[0]
    assert all("what differs here (one program over the 2 launched ranks):" in plan for plan in plans)
    # --colocate_actor_ref on one rank, the critic on the other
    assert "  ref: ranks 0, 1 data-parallel replica(s)\n  critic: ranks 1, 1 data-parallel" in plans[1]
    assert not any((tmp_path / str(i) / "save" / "metrics.jsonl").exists() for i in range(3))


H200_MEASURED_MIB = {"sft": {"train": 1712.4},
                     "ppo": {"generation": 728.7, "experience": 731.6, "train": 1853.4, "weight_sync": 712.2}}
"""Rank 0's max_memory_allocated per stage in tests/gpu/test_memory_plan_cuda.py (benchmarks/gpu_smoke.sh's
memory_plan section) on one H200, 2026-11-30: benchmarks/memory_plan.py's 37.7M-parameter Llama, bf16, ZeRO-2,
packed, one rank. The plan then said 853 MiB for SFT's and 997 MiB for PPO's training (0.50 and 0.54 of these): it
counted the reduce bucket as the gradients it holds, where DeepSpeed allocates all 5e8 elements on CUDA."""


@pytest.mark.parametrize("job", ["sft", "ppo"])
def test_cuda_plan_is_within_25_percent_of_the_h200_peaks(job, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import memory_plan as bench
    from transformers import LlamaConfig

    from rlhf.config.jobs import JOBS
    from rlhf.planning.report import stage_estimates

    model = tmp_path / "model"
    LlamaConfig(num_key_value_heads=8, head_dim=64, tie_word_embeddings=False, **bench.SHAPE).save_pretrained(model)
    inputs = {job: ["--pretrain", str(model), "--dataset" if job == "sft" else "--prompt_data", "rows.jsonl"]
              + (["--remote_rm_url", "reward.py"] if job == "ppo" else [])}
    module, *argv = bench.job_argv(job, 2, "packed", inputs, str(tmp_path / "save"), cuda=True)[1:]
    root = next(j for j in JOBS if j.name == module.rsplit(".", 1)[-1]).root_class()
    cfg = parse_config(root, [*argv, "--gpu_memory_gb", "141"])
    plan = plan_ranks(placement_from_config(cfg), 1) if job == "ppo" else {Role.define("model"): (0,)}
    planned = stage_estimates(job_memory(cfg, plan), 1, 0)
    for stage, measured in H200_MEASURED_MIB[job].items():
        assert abs(planned[stage] / MiB / measured - 1) <= 0.25, (stage, planned[stage] / MiB, measured)
