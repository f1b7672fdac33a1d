"""What the OpenRLHF v0.9.5 flags built for issue 27 item 8 do: the DeepSpeed config keys of --zpg and
--grad_accum_dtype, the tokenizer kind of --disable_fast_tokenizer, the checkpointing variant of
--gradient_checkpointing_use_reentrant, the wandb entity of --wandb_org, train_dpo's --min_lr_ratio floor, PPO's
--prompt_data_probs mixing, --max_len as vLLM's max_model_len and --enable_ema's average (on a real engine:
tests/dist/test_deepspeed_flags.py)."""

from __future__ import annotations

import json
import sys
import types
import warnings

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.flags import parse_config
from rlhf.config.inference_config import BatchInferenceConfig
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.config.preference_config import TrainDPOConfig, TrainKTOConfig
from rlhf.config.shared_config import EngineConfig, OptimConfig
from rlhf.config.supervised_config import TrainKDConfig, TrainPRMConfig, TrainRMConfig, TrainSFTConfig

TRAINING_JOBS = (TrainPPOConfig, TrainSFTConfig, TrainRMConfig, TrainPRMConfig, TrainKDConfig, TrainDPOConfig,
                 TrainKTOConfig)


def quiet_parse(cls, *argv):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return parse_config(cls, list(argv))


def test_zpg_and_grad_accum_dtype_are_deepspeed_config_keys():
    from rlhf.engines.deepspeed_engine import ds_config

    for cls in TRAINING_JOBS:
        engine = quiet_parse(cls, "--zero_stage", "3", "--zpg", "8", "--grad_accum_dtype", "fp32").engine
        config = ds_config(engine, OptimConfig(), bf16=True, micro_batch_size=1, grad_accum_steps=1)
        assert config["zero_optimization"]["zero_hpz_partition_size"] == 8
        assert config["data_types"] == {"grad_accum_dtype": "fp32"}
        assert engine.hpz_size == 8
    default = ds_config(EngineConfig(), OptimConfig(), bf16=True, micro_batch_size=1, grad_accum_steps=1)
    assert default["zero_optimization"]["zero_hpz_partition_size"] == 1  # v0.9.5's default --zpg 1: no hpZ
    assert default["data_types"] == {"grad_accum_dtype": None}  # DeepSpeed: the parameter dtype
    with pytest.warns(UserWarning, match="--zpg 8 has no effect at --zero_stage 2"):
        assert parse_config(TrainSFTConfig, ["--zpg", "8"]).engine.hpz_size == 1


def test_disable_fast_tokenizer_reaches_every_job():
    for cls in (*TRAINING_JOBS, BatchInferenceConfig):
        base = ["--eval_task", "generate", "--output_path", "out.jsonl"] if cls is BatchInferenceConfig else []
        assert quiet_parse(cls, *base, "--disable_fast_tokenizer").model.disable_fast_tokenizer
        assert not quiet_parse(cls, *base).model.disable_fast_tokenizer


def test_slow_tokenizer_arguments_per_transformers_release(tmp_path):
    """transformers 4: use_fast=False (OpenRLHF's call). transformers 5 has no slow classes: the sentencepiece
    backend where the model has a sentencepiece file, else the fast tokenizer with a warning."""
    from rlhf.models.loading import slow_tokenizer_kwargs

    assert slow_tokenizer_kwargs(str(tmp_path), 4) == {"use_fast": False}
    with pytest.warns(UserWarning, match="--disable_fast_tokenizer has no effect on .*no sentencepiece model"):
        assert slow_tokenizer_kwargs(str(tmp_path), 5) == {}
    (tmp_path / "tokenizer.model").write_bytes(b"")
    assert slow_tokenizer_kwargs(str(tmp_path), 5) == {"backend": "sentencepiece"}


def test_load_tokenizer_passes_the_slow_request_to_transformers(monkeypatch):
    import transformers

    from rlhf.models.loading import load_tokenizer

    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        seen.append(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    monkeypatch.setattr(transformers, "__version__", "4.57.0")
    load_tokenizer(EMBEDDED_MODEL_DIR, use_fast=False)
    load_tokenizer(EMBEDDED_MODEL_DIR)
    assert seen[0]["use_fast"] is False and "use_fast" not in seen[1]


def test_gradient_checkpointing_use_reentrant_reaches_the_engine(monkeypatch):
    from rlhf.core import role_models
    from rlhf.distributed.topology import Role

    built = {}
    monkeypatch.setattr(role_models, "DeepSpeedModel", lambda build, *a, **kw: built.update(kw))
    topology = types.SimpleNamespace(has_subgroups=False, group=lambda role: None, hpz_group=lambda role: None,
                                     tp_group=lambda role: None, data_group=lambda role: None)
    for argv, reentrant in (([], False), (["--gradient_checkpointing_use_reentrant"], True)):
        cfg = quiet_parse(TrainSFTConfig, "--gradient_checkpointing", *argv)
        role_models.role_model(None, cfg.model, cfg.engine, cfg.optim, topology, Role.ACTOR, torch.device("cpu"),
                               trainable=True, micro_batch_size=1)
        assert built["gradient_checkpointing"] and built["checkpoint_reentrant"] is reentrant


def test_wandb_org_is_the_wandb_entity(tmp_path, monkeypatch):
    from rlhf.core.run import metrics_logger

    inits = []
    fake = types.SimpleNamespace(login=lambda key: None, init=lambda **kw: inits.append(kw) or types.SimpleNamespace(
        log=lambda metrics, step: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for argv, entity in ((["--wandb_org", "my-team"], "my-team"), ([], None)):
        cfg = quiet_parse(TrainSFTConfig, "--use_wandb", "True", "--save_path", str(tmp_path), *argv)
        metrics_logger(cfg, 1, is_writer=True, bar_desc="steps", bar_metrics={}).close()
        assert inits[-1]["entity"] == entity and inits[-1]["project"] == "openrlhf_train_sft"


def final_lr(optim: OptimConfig, lr: float = 1.0, steps: int = 10) -> float:
    from rlhf.engines.deepspeed_engine import _scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = _scheduler(optimizer, optim, steps)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


def test_min_lr_ratio_is_the_cosine_floor_of_train_dpo():
    """v0.9.5: train_dpo's cosine_with_min_lr ends at --min_lr_ratio x the learning rate (default 0.1); every
    other job keeps the hard-coded 0.1."""
    assert final_lr(quiet_parse(TrainDPOConfig, "--min_lr_ratio", "0.25").optim) == pytest.approx(0.25)
    assert final_lr(quiet_parse(TrainDPOConfig).optim) == pytest.approx(0.1)
    for cls in (TrainSFTConfig, TrainKTOConfig, TrainPPOConfig):
        assert final_lr(quiet_parse(cls).optim) == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"--min_lr_ratio must lie in \[0, 1\]"):
        parse_config(TrainDPOConfig, ["--min_lr_ratio", "1.5"])


def write_rows(path, texts):
    path.write_text("".join(json.dumps({"input": t}) + "\n" for t in texts))
    return str(path)


def test_prompt_data_probs_mixes_prompt_sources_as_dataset_probs(tmp_path):
    """Two prompt files mixed 0.7 / 0.3 with --seed: the prompts come in the order OpenRLHF's blending
    (`interleave_order`) gives, the same rows a supervised job's --dataset / --dataset_probs reads."""
    from rlhf.data.prompts import load_prompts
    from rlhf.data.sources import interleave_order, read_rows
    from rlhf.models.loading import load_tokenizer

    a = write_rows(tmp_path / "a.jsonl", [f"copy {i} :" for i in range(5)])
    b = write_rows(tmp_path / "b.jsonl", [f"copy {i} {i} :" for i in range(3)])
    cfg = quiet_parse(TrainPPOConfig, "--prompt_data", f"{a},{b}", "--prompt_data_probs", "0.7,0.3").data
    prompts = load_prompts(cfg, load_tokenizer(EMBEDDED_MODEL_DIR), seed=7)
    sources = ([f"copy {i} :" for i in range(5)], [f"copy {i} {i} :" for i in range(3)])
    assert [p.text for p in prompts] == [sources[s][i] for s, i in interleave_order([5, 3], [0.7, 0.3], 7)]
    supervised = read_rows(f"{a},{b}", probs="0.7,0.3", split="train", max_samples=10**6, seed=7, flag="--dataset")
    assert [p.text for p in prompts] == [row.data["input"] for row in supervised]
    unmixed = load_prompts(quiet_parse(TrainPPOConfig, "--prompt_data", f"{a},{b}").data,
                           load_tokenizer(EMBEDDED_MODEL_DIR))
    assert [p.text for p in unmixed] == [*sources[0], *sources[1]]  # no probabilities: concatenated in order
    with pytest.raises(ValueError, match="--prompt_data_probs 0.7: 1 probabilities for 2 sources in --prompt_data"):
        load_prompts(quiet_parse(TrainPPOConfig, "--prompt_data", f"{a},{b}", "--prompt_data_probs", "0.7").data,
                     load_tokenizer(EMBEDDED_MODEL_DIR))


def test_max_len_is_the_rollout_engines_max_model_len(monkeypatch):
    """v0.9.5: --max_len only sets vLLM's max_model_len, by default --prompt_max_len + --generate_max_len."""
    import rlhf.engines.vllm_engine as vllm_engine
    from rlhf.trainers.ppo_run import build_rollout_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kw: seen.update(kw))
    lengths = ("--prompt_max_len", "100", "--generate_max_len", "50", "--rollout_engine", "vllm")
    for argv, expected in (((), 150), (("--max_len", "4096"), 4096)):
        cfg = quiet_parse(TrainPPOConfig, *lengths, *argv)
        assert cfg.max_model_len == expected
        build_rollout_engine(cfg.rollout, cfg.model, torch.device("cpu"), None, seed=cfg.seed,
                             max_model_len=cfg.max_model_len)
        assert seen["max_model_len"] == expected


def test_ema_update_by_hand():
    """ema <- beta ema + (1 - beta) w: from 1 with beta 0.992, w = 2 then 3: 1.008, then 0.992 x 1.008 + 0.024."""
    from rlhf.engines.weight_ema import ema_update_

    ema = torch.tensor([1.0], dtype=torch.float64)
    ema_update_(ema, torch.tensor([2.0], dtype=torch.bfloat16), 0.992)
    assert float(ema) == pytest.approx(1.008)
    ema_update_(ema, torch.tensor([3.0]), 0.992)
    assert float(ema) == pytest.approx(0.992 * 1.008 + 0.008 * 3.0)


def test_enable_ema_gives_the_actor_an_average(monkeypatch):
    """--enable_ema --ema_beta reach the actor's engine (not other policies'), the algorithm line says what is
    saved, and LoRA (adapters only) is refused."""
    from rlhf.trainers import ppo_build

    engines = []
    monkeypatch.setattr(ppo_build, "_engine", lambda *a, **kw: engines.append(kw) or types.SimpleNamespace())
    monkeypatch.setattr(ppo_build, "Actor", lambda *a, **kw: None)
    topology = types.SimpleNamespace(group=lambda role: None, ring_group=lambda role: None,
                                     data_group=lambda role: None)
    for argv, beta in ((["--enable_ema", "--ema_beta", "0.9"], 0.9), (["--enable_ema"], 0.992), ([], None)):
        cfg = quiet_parse(TrainPPOConfig, *argv)
        assert cfg.optim.actor_ema_beta == beta
        ppo_build.build_policy(ppo_build.EngineInputs.of(cfg, 1), cfg.algo, 1.0, topology, None, torch.device("cpu"),
                               1e-6, ema_beta=cfg.optim.actor_ema_beta)
        assert engines[-1]["ema_beta"] == beta
    with pytest.warns(UserWarning, match="--ema_beta 0.9 has no effect without --enable_ema"):
        parse_config(TrainPPOConfig, ["--ema_beta", "0.9"])
    with pytest.raises(ValueError, match="--enable_ema averages the actor's full weights"):
        parse_config(TrainPPOConfig, ["--enable_ema", "--lora_rank", "8"])
