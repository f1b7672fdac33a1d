"""Gathering a ZeRO-3 model for saving: only the writer keeps the gathered weights, and save_hf round-trips."""

import os

import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.distributed import run_on_ranks


def _save_on_zero3(path: str) -> dict:
    """Gather and save the embedded policy from ZeRO-3 shards; record what each rank held."""
    import torch.distributed as dist

    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    is_writer = dist.get_rank() == 0
    model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa"),
                           EngineConfig(zero_stage=3), OptimConfig(), learning_rate=1e-3, bf16=False,
                           micro_batch_size=1, grad_accum_steps=1, num_optimizer_steps=1,
                           device=torch.device("cpu"), dp_group=dist.group.WORLD)
    partitioned = all(p.numel() == 0 for p in model.module.parameters())
    state = model.gathered_state_dict(is_writer)
    real = model.full_parameters
    kept_by_save: list[str] = []

    def counting(*args, **kwargs):
        for name, tensor in real(*args, **kwargs):
            kept_by_save.append(name)
            yield name, tensor

    model.full_parameters = counting  # what save_hf keeps on this rank
    model.save_hf(path, load_tokenizer(EMBEDDED_MODEL_DIR), is_writer)
    dist.barrier()
    return {"partitioned": partitioned, "state": state, "kept_by_save": len(kept_by_save)}


def test_only_the_writer_keeps_the_gathered_model_and_save_hf_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf.models.loading import load_causal_lm

    writer, other = run_on_ranks(2, _save_on_zero3, str(tmp_path / "hf"))
    original = dict(load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").named_parameters())
    assert writer["partitioned"] and other["partitioned"]
    assert other["state"] == {} and other["kept_by_save"] == 0
    assert writer["kept_by_save"] == len(original)
    assert writer["state"].keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(writer["state"][name], tensor), name
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, local_files_only=True)
    saved_params = dict(saved.named_parameters())
    assert saved_params.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(saved_params[name], tensor), name
    assert os.path.exists(tmp_path / "hf" / "tokenizer_config.json")
