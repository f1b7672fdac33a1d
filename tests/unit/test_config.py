"""OpenRLHF-style flags parse into the typed config tree; bad flags and values fail with clear messages."""

import json
import os
import re
import warnings

import pytest
import torch

from rlhf.config.flags import IGNORED_FLAGS, flag_specs, parse_config
from rlhf.config.ppo_config import TrainPPOConfig


def parse(*argv):
    return parse_config(TrainPPOConfig, list(argv))


def test_flags_land_in_their_sub_configs():
    cfg = parse("--pretrain", "/m", "--prompt_data", "p.jsonl", "--remote_rm_url", "r.py",
                "--actor_learning_rate", "5e-7", "--adam_betas", "0.8", "0.9", "--zero_stage", "3",
                "--n_samples_per_prompt", "8", "--advantage_estimator", "reinforce_baseline", "--bf16",
                "--eps_clip_low_high", "0.2", "0.28", "--label_key", "answer", "--use_tensorboard", "tb")
    assert cfg.model.pretrain == "/m" and cfg.model.bf16 and cfg.model.dtype == torch.bfloat16
    assert cfg.optim.actor_learning_rate == 5e-7 and cfg.optim.adam_betas == (0.8, 0.9)
    assert cfg.engine.zero_stage == 3
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.algo.advantage_estimator == "reinforce_baseline"
    assert cfg.algo.clip_range == (0.2, 0.28)
    assert cfg.data.label_key == "answer"
    assert cfg.logging.use_tensorboard == "tb"


def test_every_flag_is_unique_and_documented():
    specs = flag_specs(TrainPPOConfig)
    names = [s.flag for s in specs]
    assert len(names) == len(set(names))
    assert all(s.help for s in specs)
    assert not set(names) & set(TrainPPOConfig.PENDING_FLAGS)
    assert not set(names) & set(IGNORED_FLAGS)


def test_unknown_flag_suggests_the_close_one(capsys):
    with pytest.raises(SystemExit):
        parse("--actor_learnig_rate", "1e-6")
    err = capsys.readouterr().err
    assert "unknown flag --actor_learnig_rate; did you mean --actor_learning_rate?" in err
    assert "unexpected value" not in err


def test_pending_flag_is_refused_not_ignored(capsys, monkeypatch):
    """An OpenRLHF flag whose feature is not built is refused by name (none is pending today: one is made up)."""
    monkeypatch.setattr(TrainPPOConfig, "PENDING_FLAGS", ("colocate_everything_twice",))
    with pytest.raises(SystemExit):
        parse("--colocate_everything_twice", "2")
    err = capsys.readouterr().err
    assert "--colocate_everything_twice is an OpenRLHF flag whose feature is not implemented yet" in err


def test_tensor_parallel_refuses_what_autotp_here_cannot_split():
    from rlhf.config.errors import UsageError

    assert parse("--ds_tensor_parallel_size", "2").engine.replica_size == 2
    for extra, want in ((("--zero_stage", "3"), "--ds_tensor_parallel_size 2 at --zero_stage 3 is not built"),
                        (("--ring_attn_size", "2"), "--ds_tensor_parallel_size 2 with --ring_attn_size 2 is not "
                                                    "built: choose one of them"),
                        (("--lora_rank", "4"), "--ds_tensor_parallel_size 2 with --lora_rank is not built"),
                        (("--enable_ema",), "--enable_ema with --ds_tensor_parallel_size 2 is not built")):
        with pytest.raises(UsageError) as err:
            parse("--ds_tensor_parallel_size", "2", *extra)
        assert want in str(err.value), extra
    from rlhf.config.preference_config import TrainDPOConfig
    from rlhf.config.supervised_config import TrainKDConfig

    for root, flag, role in ((TrainDPOConfig, "--ref_num_gpus_per_node", "reference"),
                             (TrainKDConfig, "--teacher_num_gpus_per_node", "teacher")):
        with pytest.raises(UsageError, match=f"a {role} on its own ranks with --ds_tensor_parallel_size is not built"):
            parse_config(root, ["--ds_tensor_parallel_size", "2", flag, "1"])


def test_non_finite_float_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--actor_learning_rate", "inf", "--adam_betas", "0.9", "nan", "--max_norm", "1.0")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: --actor_learning_rate inf is not a finite number; give a finite value" in err
    assert "error: --adam_betas 0.9 nan is not a finite number" in err
    assert "--max_norm" not in err


def test_ignored_flag_warns_and_consumes_its_value():
    with pytest.warns(UserWarning, match="--vllm_sync_backend is ignored"):
        cfg = parse("--vllm_sync_backend", "nccl", "--seed", "3")
    assert cfg.seed == 3
    with pytest.warns(UserWarning, match="--vllm_sync_with_ray is ignored"):
        assert parse("--vllm_sync_with_ray", "--seed", "4").seed == 4
    with pytest.warns(UserWarning, match="--save_value_network is ignored: train_ppo always saves the critic"):
        assert parse("--save_value_network", "--seed", "5").seed == 5  # a switch: takes no value


@pytest.mark.parametrize("argv,message", [
    (["--advantage_estimator", "group_norm"], "group_norm compares samples of one prompt: --n_samples_per_prompt "
                                              "must be > 1 (got 1)"),
    (["--advantage_estimator", "dr_grpo", "--n_samples_per_prompt", "1"], "--n_samples_per_prompt must be > 1"),
    (["--pretrain", "/m", "--remote_rm_url", "r.py"], "--pretrain /m is given but --prompt_data is not"),
    (["--pretrain", "/m", "--prompt_data", "p.jsonl"], "--pretrain /m is given but no reward source: add "
                                                       "--reward_pretrain"),
    (["--param_dtype", "fp8"], "--param_dtype 'fp8': choose bf16, fp16 or fp32"),
    (["--bf16", "--param_dtype", "fp32"], "--bf16 contradicts --param_dtype fp32"),
    (["--vllm_is_correction_type", "clamp"], "--vllm_is_correction_type 'clamp': choose tis, icepop or seq-mask-tis"),
    (["--max_len", "100", "--prompt_max_len", "64", "--generate_max_len", "64"],
     "--max_len 100 (vLLM's max_model_len) cannot hold a prompt of --prompt_max_len 64 tokens"),
    (["--zpg", "0"], "--zpg 0 must be >= 1"),
    (["--grad_accum_dtype", "fp8"], "--grad_accum_dtype 'fp8': choose fp32, bf16 or fp16"),
    (["--grad_accum_dtype", "fp32", "--zero_stage", "0"], "--grad_accum_dtype fp32 differs from --param_dtype bf16"),
    (["--grad_accum_dtype", "fp32", "--zero_stage", "1"], "makes DeepSpeed switch to its BF16_Optimizer"),
    (["--eval_steps", "0"], "--eval_steps must be -1 (the default schedule) or >= 1"),
    (["--dist_timeout", "0"], "--dist_timeout must be > 0"),
    (["--watchdog_interval", "-1"], "--watchdog_interval must be >= 0"),
    (["--reward_func_timeout", "-1"], "--reward_func_timeout must be >= 0"),
    (["--advantage_estimator", "ppo"], "--advantage_estimator 'ppo': choose one of gae, reinforce"),
    (["--advantage_estimator", "rloo", "--n_samples_per_prompt", "1"], "rloo compares samples of one prompt"),
    (["--dual_clip", "0.5"], "--dual_clip must be > 1"),
    (["--kl_estimator", "k4"], "--kl_estimator: choose k1, k2 or k3"),
    (["--overlong_buffer_len", "5000", "--generate_max_len", "100"], "--overlong_buffer_len must lie in"),
    (["--zero_stage", "4"], "--zero_stage 4"),
    (["--input_template", "no placeholder"], "exactly one '{}'"),
    (["--train_batch_size", "2000"], "--train_batch_size 2000 exceeds"),
])
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(*argv)


def test_world_checks():
    cfg = parse("--rollout_batch_size", "6", "--n_samples_per_prompt", "2", "--train_batch_size", "12",
                "--micro_train_batch_size", "2")
    cfg.check_world(3)
    cfg.check_world(4)  # one rank per engine: 6 prompts over 4 engines take 2, 1, 2, 1 (more engines: some idle)
    cfg.check_world(12)
    tp2 = parse("--rollout_batch_size", "6", "--n_samples_per_prompt", "2", "--train_batch_size", "12",
                "--micro_train_batch_size", "2", "--vllm_tensor_parallel_size", "2")
    with pytest.raises(ValueError, match="--rollout_batch_size 6 must be divisible by the number of rollout engines"):
        tp2.check_world(8)
    tp = parse("--rollout_batch_size", "3", "--vllm_tensor_parallel_size", "2", "--train_batch_size", "3",
               "--micro_train_batch_size", "2")
    with pytest.raises(ValueError, match="each engine's 3 prompts must split evenly over its 2 ranks"):
        tp.check_world(2)


def test_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--help")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--actor_learning_rate" in out and "--use_kl_loss" in out  # pending ones are listed as such


def test_critic_flags_with_a_critic_free_estimator_warn():
    with pytest.warns(UserWarning, match="group_norm uses no critic: critic flags are ignored"):
        parse("--critic_pretrain", "/c", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4")
    assert parse("--advantage_estimator", "reinforce", "--n_samples_per_prompt", "1").rollout.n_samples_per_prompt == 1


def test_role_sizes_must_split_the_batch():
    cfg = parse("--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                "--micro_train_batch_size", "2")
    cfg.check_role_sizes({"actor": 2, "critic": 2, "reward": 4}, trainable=("actor", "critic"))
    with pytest.raises(ValueError, match="the 8 samples of a step do not split over the 3 reward ranks"):
        cfg.check_role_sizes({"actor": 2, "reward": 3}, trainable=("actor",))
    with pytest.raises(ValueError, match="multiple of --micro_train_batch_size 2 x 8 actor ranks"):
        cfg.check_role_sizes({"actor": 8}, trainable=("actor",))


def test_ring_attention_flags():
    with pytest.warns(UserWarning, match=r"^--ring_attn_size > 1 works on packed sequences: turning on "
                                         r"--packing_samples$"):
        assert parse("--ring_attn_size", "2").engine.packing_samples
    cfg = parse("--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                "--micro_train_batch_size", "2", "--packing_samples", "--ring_attn_size", "2")
    # 8 ranks in rings of 2: 4 data-parallel replicas of 2 samples each
    cfg.check_role_sizes({"actor": 8}, trainable=("actor",))
    with pytest.raises(ValueError, match="the 3 reward ranks do not split into rings of --ring_attn_size 2"):
        cfg.check_role_sizes({"actor": 2, "reward": 3}, trainable=("actor",))
    with pytest.raises(ValueError, match="multiple of --micro_train_batch_size 2 x 8 actor ranks"):
        cfg.check_role_sizes({"actor": 16}, trainable=("actor",))
    with pytest.raises(ValueError, match="--ring_attn_size must be >= 1"):
        parse("--ring_attn_size", "0", "--packing_samples")


def test_dynamic_batch_turns_packing_on_and_needs_a_budget_that_holds_one_sample():
    with pytest.warns(UserWarning, match=r"^--ring_attn_size > 1 and --use_dynamic_batch work on packed sequences: "
                                         r"turning on --packing_samples$"):
        assert parse("--use_dynamic_batch", "--ring_attn_size", "2").engine.packing_samples
    short = ("--prompt_max_len", "100", "--generate_max_len", "60", "--packing_samples", "--use_dynamic_batch")
    with pytest.raises(ValueError, match="--train_max_tokens_per_gpu 150 cannot hold one sample of up to 160 tokens"):
        parse(*short, "--train_max_tokens_per_gpu", "150")
    with pytest.raises(ValueError, match="--rollout_max_tokens_per_gpu 100 cannot hold one sample of up to 160 "
                                         "tokens .* raise it to at least 160"):
        parse(*short, "--rollout_max_tokens_per_gpu", "100")
    # a ring of 2 pads 160 tokens to a multiple of 4 and gives each rank half: 80 per rank
    parse(*short, "--train_max_tokens_per_gpu", "80", "--ring_attn_size", "2")
    with pytest.raises(ValueError, match="79 cannot hold one sample of up to 160 tokens .*, 80 per rank"):
        parse(*short, "--train_max_tokens_per_gpu", "79", "--ring_attn_size", "2")


def test_ring_head_stride_must_divide_the_kv_heads():
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.trainers.ppo_build import check_models

    short = ("--prompt_max_len", "16", "--generate_max_len", "16")
    check_models(parse(*short, "--packing_samples", "--ring_attn_size", "2", "--ring_head_stride", "2")
                 .with_demo_defaults())
    with pytest.raises(ValueError, match=f"--ring_head_stride 3 must divide the 2 key/value heads of "
                                         f"--pretrain {EMBEDDED_MODEL_DIR}"):
        check_models(parse(*short, "--packing_samples", "--ring_attn_size", "2", "--ring_head_stride", "3")
                     .with_demo_defaults())


def test_dynamic_batch_budget_errors_name_the_flag():
    from rlhf.models.micro_batches import MicroBatcher

    mask = torch.tensor([[1] * 9 + [0], [1] * 10])
    batcher = MicroBatcher(4, max_tokens=8, flag="--rollout_max_tokens_per_gpu")
    with pytest.raises(ValueError, match="--rollout_max_tokens_per_gpu 8 is below a sample of 10 tokens per rank; "
                                         "raise it to at least 10"):
        batcher.split(mask)
    assert MicroBatcher(4, max_tokens=10).split(mask) == [[0], [1]]
    assert MicroBatcher(4, max_tokens=19).split(mask) == [[0, 1]]
    assert MicroBatcher(1).split(mask) == [[0], [1]]


def test_dynamic_batch_deals_each_replica_an_even_token_share():
    """--use_dynamic_batch deals an optimizer step's samples to the data-parallel replicas by length (equal counts,
    even token totals, as OpenRLHF balances them under that flag); without it each replica takes a contiguous
    share, as before. Either way the replicas' rows cover the step once."""
    from rlhf.models.micro_batches import MicroBatcher, balanced_shares

    # 9..2 tokens: longest first, each to the lighter replica with room: 9, 8, 7 (to the 8), 6 (to the 9), ...
    assert balanced_shares([9, 8, 7, 6, 5, 4, 3, 2], 2) == [[0, 3, 4, 7], [1, 2, 5, 6]]  # 22 and 22 tokens
    assert balanced_shares([10, 1, 1, 1], 2) == [[0, 3], [1, 2]]  # equal counts even when the tokens cannot be
    assert balanced_shares([3, 3, 3, 3, 3, 3], 3) == [[0, 3], [1, 4], [2, 5]]  # ties: the lower replica first
    with pytest.raises(ValueError, match="do not split evenly over 2 ranks"):
        balanced_shares([1, 2, 3], 2)
    lengths = [12, 3, 11, 2, 9, 4, 10, 1]
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lengths])
    dynamic = [MicroBatcher(4, max_tokens=64).replica_rows(mask, 2, r) for r in range(2)]
    assert dynamic == [[0, 4, 5, 7], [1, 2, 3, 6]]
    assert [sum(lengths[i] for i in rows) for rows in dynamic] == [26, 26]  # contiguous shares: 28 and 24 tokens
    assert [MicroBatcher(4).replica_rows(mask, 2, r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_ppo_trainer_deals_optimizer_steps_by_tokens_with_dynamic_batching():
    """PPOTrainer._optimizer_batches with 2 replicas on 4 samples of 9, 7, 11 and 8 tokens (one optimizer step):
    with --use_dynamic_batch the replicas hold 18 and 17 tokens (the best split in equal counts); each sample is
    trained on once either way."""
    from types import SimpleNamespace

    from rlhf.distributed.topology import Role
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.trainers.ppo_trainer import PPOTrainer
    from tests.tiny_actor import synthetic_experiences

    exp = synthetic_experiences(vocab=64)
    lengths = exp.attention_mask_BT.sum(-1).tolist()
    assert lengths == [9, 7, 11, 8]

    def shares(batcher: MicroBatcher, seed: int) -> list[list[int]]:
        out = []
        for rank in range(2):
            trainer = SimpleNamespace(topology=SimpleNamespace(dp_size=lambda role: 2, dp_rank=lambda role, r=rank: r),
                                      cfg=SimpleNamespace(seed=seed, batch=SimpleNamespace(train_batch_size=4)))
            (micro,) = PPOTrainer._optimizer_batches(trainer, exp, Role.ACTOR, batcher, step=0, epoch=0)
            out.append(sorted(int(n) for part in micro for n in part.attention_mask_BT.sum(-1)))
        return out

    for seed in range(4):
        dynamic = shares(MicroBatcher(2, max_tokens=64), seed)
        assert sorted(dynamic[0] + dynamic[1]) == sorted(lengths) and list(map(len, dynamic)) == [2, 2]
        assert sorted(map(sum, dynamic)) == [17, 18], seed
        fixed = shares(MicroBatcher(2), seed)
        assert sorted(fixed[0] + fixed[1]) == sorted(lengths) and list(map(len, fixed)) == [2, 2]
    assert any(max(map(sum, shares(MicroBatcher(2), seed))) > 18 for seed in range(4))  # contiguous: uneven


def test_defaults_are_openrlhf_v0_9_5():
    """A script that relies on a default runs OpenRLHF v0.9.5's algorithm (train_ppo_ray.py of that tag)."""
    cfg = parse()
    a, r, b = cfg.algo, cfg.rollout, cfg.batch
    assert (a.advantage_estimator, a.init_kl_coef, a.kl_estimator, a.lambd, a.gamma) == ("gae", 0.01, "k1", 1.0, 1.0)
    assert (a.eps_clip, a.value_clip, a.entropy_loss_coef, a.reward_clip_range) == (0.2, 0.5, None, (-10.0, 10.0))
    assert (a.vllm_is_truncated_threshold, a.vllm_is_correction_type) == ((0.5, 5.0), "tis")
    assert (r.n_samples_per_prompt, r.temperature, r.top_p, r.generate_max_len) == (1, 1.0, 1.0, 1024)
    assert r.vllm_gpu_memory_utilization == 0.95
    assert (b.rollout_batch_size, b.micro_rollout_batch_size, b.train_batch_size, b.micro_train_batch_size) == \
        (1024, 8, 128, 4)
    assert (b.max_epochs, b.num_episodes, cfg.data.prompt_max_len, cfg.seed) == (1, 1, 1024, 42)
    o = cfg.optim
    assert (o.actor_learning_rate, o.critic_learning_rate, o.lr_warmup_ratio, o.lr_scheduler) == \
        (1e-6, 9e-6, 0.03, "cosine_with_min_lr")
    assert (o.adam_betas, o.l2, o.max_norm, cfg.engine.zero_stage) == ((0.9, 0.95), 0.0, 1.0, 2)
    assert (cfg.model.param_dtype, cfg.model.attn_implementation) == ("bf16", "flash_attention_2")
    assert cfg.engine.train_max_tokens_per_gpu == 16192
    assert (cfg.logging.save_path, cfg.checkpoint.ckpt_path, cfg.logging.wandb_project) == \
        ("./ckpt", "./ckpt/checkpoints_ppo_ray", "openrlhf_train_ppo")
    assert (cfg.logging.eval_steps, cfg.checkpoint.save_steps, cfg.checkpoint.max_ckpt_num) == (-1, -1, 3)


def test_help_shows_the_openrlhf_defaults(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--advantage_estimator", "gae"), ("--init_kl_coef", "0.01"), ("--n_samples_per_prompt", "1"),
                          ("--lambd", "1.0"), ("--value_clip", "0.5"), ("--param_dtype", "bf16")):
        assert re.search(rf"{flag} \S+ .*?\(default: {re.escape(default)}\)", out), flag


def test_embedded_demo_only_without_pretrain():
    from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_PROMPTS, EMBEDDED_REWARD

    demo = parse().with_demo_defaults()
    assert (demo.model.pretrain, demo.data.prompt_data, demo.reward.source) == \
        (EMBEDDED_MODEL_DIR, EMBEDDED_PROMPTS, EMBEDDED_REWARD)
    # OpenRLHF's lengths (1024 + 1024) exceed the demo policy's 256 positions: the demo's, unless given
    # and its 512 prompts are fewer than OpenRLHF's --rollout_batch_size 1024
    assert (demo.data.prompt_max_len, demo.rollout.generate_max_len, demo.batch.rollout_batch_size) == (16, 8, 128)
    given = parse("--prompt_max_len", "32", "--generate_max_len", "12", "--rollout_batch_size", "256")
    given = given.with_demo_defaults()
    assert (given.data.prompt_max_len, given.rollout.generate_max_len, given.batch.rollout_batch_size) == (32, 12, 256)
    # the user's own prompts and reward are kept; only the policy comes from the demo
    own = parse("--prompt_data", "mine.jsonl", "--reward_pretrain", "/rm").with_demo_defaults()
    assert (own.data.prompt_data, own.reward.reward_paths, own.reward.source) == ("mine.jsonl", ["/rm"], "")
    assert own.batch.rollout_batch_size == 1024
    # the embedded model's path given explicitly is a --pretrain like any other
    with pytest.raises(ValueError, match="is given but --prompt_data is not"):
        parse("--pretrain", EMBEDDED_MODEL_DIR, "--remote_rm_url", "r.py")
    user = parse("--pretrain", "/m", "--prompt_data", "p.jsonl", "--remote_rm_url", "r.py")
    assert user.with_demo_defaults() is user


def test_openrlhf_compatible_values_are_accepted():
    cfg = parse("--eval_steps", "-1", "--param_dtype", "fp16", "--flash_attn")
    assert cfg.model.dtype == torch.float16 and cfg.model.attn == "flash_attention_2"
    assert parse("--vllm_is_correction_type", "icepop").algo.is_correction_type == "icepop"
    assert parse("--use_icepop").algo.is_correction_type == "icepop"
    assert parse("--vllm_is_correction_type", "seq-mask-tis").algo.is_correction_type == "seq-mask-tis"
    with pytest.raises(ValueError, match="--use_icepop contradicts --vllm_is_correction_type seq-mask-tis"):
        parse("--use_icepop", "--vllm_is_correction_type", "seq-mask-tis")
    with pytest.warns(UserWarning, match="--eval_steps 10 has no effect: there is no --eval_dataset"):
        parse("--eval_steps", "10")


def test_reward_pretrain_with_remote_rm_url_follows_openrlhf():
    with pytest.warns(UserWarning, match="--reward_pretrain is not used: rewards come from --remote_rm_url r.py"):
        cfg = parse("--pretrain", "/m", "--prompt_data", "p.jsonl", "--reward_pretrain", "/rm", "--remote_rm_url",
                    "r.py")
    assert cfg.reward.reward_paths == [] and cfg.reward.source == "r.py"
    assert cfg.critic_init == "/m"  # OpenRLHF: with a remote reward the critic starts from the policy
    assert parse("--pretrain", "/m", "--prompt_data", "p", "--reward_pretrain", "/rm,/rm2").critic_init == "/rm"


def test_flash_attention_without_cuda_warns_and_uses_sdpa():
    from rlhf.core.run import for_this_machine

    if torch.cuda.is_available():
        pytest.skip("this machine can run flash-attn; the fallback is for CPU machines")
    with pytest.warns(UserWarning, match=r"--flash_attn: there is no CUDA device, so attention runs on PyTorch SDPA"):
        cfg = for_this_machine(parse("--flash_attn"))
    assert cfg.model.attn == "sdpa"
    with pytest.warns(UserWarning, match=r"--attn_implementation flash_attention_2 \(the default\): there is no CUDA"):
        for_this_machine(parse())
    with pytest.raises(ValueError, match="--param_dtype fp16 needs CUDA"):
        for_this_machine(parse("--param_dtype", "fp16"))
    with pytest.raises(ValueError, match=r"^--deepcompile needs CUDA: DeepSpeed's DeepCompile runtime is CUDA and NCCL "
                                         r"code .* \(cuda.h: No such file or directory\); drop the flag here$"):
        for_this_machine(parse("--attn_implementation", "sdpa", "--deepcompile"))


def test_prompt_and_generation_lengths_must_fit_the_model():
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.trainers.ppo_build import check_models

    limit = json.load(open(os.path.join(EMBEDDED_MODEL_DIR, "config.json")))["max_position_embeddings"]
    check_models(parse("--prompt_max_len", "16", "--generate_max_len", str(limit - 16)).with_demo_defaults())
    with pytest.raises(ValueError, match=rf"--prompt_max_len 16 \+ --generate_max_len {limit} = {limit + 16} tokens "
                                         rf"exceeds the {limit} positions of --pretrain"):
        check_models(parse("--prompt_max_len", "16", "--generate_max_len", str(limit)).with_demo_defaults())


def test_offload_flags_that_do_nothing_at_a_zero_stage_warn():
    with pytest.warns(UserWarning, match="--deepspeed_enable_sleep has no effect at --zero_stage 0"):
        parse("--deepspeed_enable_sleep", "--zero_stage", "0")
    with pytest.warns(UserWarning, match="--ref_reward_offload has no effect at --zero_stage 3"):
        parse("--ref_reward_offload", "--zero_stage", "3")


def test_readme_lists_exactly_the_refused_flags_of_every_job(monkeypatch):
    """README's table of refused ("not built yet") flags equals each job parser's refused set, so the two cannot
    drift; every CLI module that parses a config root appears in it or refuses nothing."""
    import importlib
    import pkgutil

    import rlhf.cli
    from tests.distributed import ROOT

    refused: dict[str, set[str]] = {}
    roots: list[type] = []
    for info in pkgutil.iter_modules(rlhf.cli.__path__):
        module = importlib.import_module(f"rlhf.cli.{info.name}")
        if not hasattr(module, "main_for") or not hasattr(module, "main"):
            continue
        monkeypatch.setattr(module, "main_for", lambda cls, *a, **k: roots.append(cls))
        module.main([])
        refused[info.name] = {f"--{flag}" for flag in roots[-1].PENDING_FLAGS}
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    table = text[text.index("| jobs | refused: not built yet |"):].split("\n\n")[0].splitlines()[2:]
    listed: dict[str, set[str]] = {}
    for row in table:
        jobs, flags = row.strip("|").split("|")
        for job in re.findall(r"`(\w+)`", jobs):
            listed[job] = set(re.findall(r"`(--\w+)`", flags))
    assert listed == {job: flags for job, flags in refused.items() if flags}
    assert {"train_ppo", "train_sft", "train_simpo", "batch_inference", "evaluate_gcg"} <= refused.keys()


def test_vllm_num_engines_0_generates_with_transformers():
    from rlhf.trainers.ppo_build import describe_generation, rollout_engine_choice

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # honoured, not "ignored"
        cfg = parse("--vllm_num_engines", "0")
    assert rollout_engine_choice(cfg.rollout) == ("hf", "--vllm_num_engines 0")
    assert describe_generation(cfg.rollout) == "generation: transformers generate (--vllm_num_engines 0)"
    assert rollout_engine_choice(parse("--rollout_engine", "vllm").rollout) == ("vllm", "--rollout_engine vllm")
    with pytest.raises(ValueError, match="--vllm_num_engines 0 means no vLLM engine, and --rollout_engine vllm"):
        parse("--vllm_num_engines", "0", "--rollout_engine", "vllm")
    with pytest.raises(ValueError, match="--async_train generates on ranks of their own: give --vllm_num_engines N"):
        parse("--vllm_num_engines", "0", "--async_train")


def test_every_job_runs_its_demo_without_flags():
    """OpenRLHF's default lengths exceed the demo model's 256 positions: without --pretrain every supervised and
    preference job uses --max_len 64 unless given (PPO: test_embedded_demo_only_without_pretrain)."""
    from rlhf.config.preference_config import TrainDPOConfig, TrainKTOConfig
    from rlhf.config.supervised_config import DEMO_MAX_LEN, TrainPRMConfig, TrainRMConfig, TrainSFTConfig

    for cls in (TrainSFTConfig, TrainRMConfig, TrainPRMConfig, TrainDPOConfig, TrainKTOConfig):
        assert parse_config(cls, []).with_demo_defaults().data.max_len == DEMO_MAX_LEN == 64
        assert parse_config(cls, ["--max_len", "32"]).with_demo_defaults().data.max_len == 32


def test_a_config_derived_during_the_run_repeats_no_note():
    """A note of the flags is shown once, when they are parsed: what the run derives from the config (the engines'
    inputs with the real step count) is built quietly (a derived config printed `--reward_pretrain is not used`
    once per derivation)."""
    from rlhf.trainers.ppo_build import EngineInputs

    with pytest.warns(UserWarning, match="--reward_pretrain is not used"):
        cfg = parse("--pretrain", "/m", "--prompt_data", "p.jsonl", "--reward_pretrain", "/rm", "--remote_rm_url",
                    "r.py")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inputs = EngineInputs.of(cfg, 7)
    assert (inputs.total_steps, inputs.batch, inputs.samples_per_prompt) == (7, cfg.batch, 1)
