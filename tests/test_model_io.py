"""Model weights in and out at scale: the value head is read by key from the one shard that holds it
(never whole shards), and under ZeRO-3 only the writer rank keeps the gathered state dict while
`save_hf` still writes the whole model."""

import json
import os

import pytest
import safetensors.torch
import torch
from safetensors.torch import save_file

import rlhf.models.value as value
from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.distributed import run_on_ranks

HEAD = "score.weight"


@pytest.fixture
def reads(monkeypatch):
    """Which (shard, key) pairs `_head_weight` reads; loading a whole shard fails the test."""
    def whole_shard(*args, **kwargs):
        raise AssertionError("a whole shard was loaded")

    monkeypatch.setattr(safetensors.torch, "load_file", whole_shard)
    monkeypatch.setattr(value, "load_file", whole_shard, raising=False)
    log: list[tuple[str, str]] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, filename, framework):
            self.name, self.inner = os.path.basename(filename), real_open(filename, framework=framework)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            log.append((self.name, key))
            return self.inner.get_tensor(key)

    monkeypatch.setattr(value, "safe_open", Spy, raising=False)
    return log


def _tensors(seed: int, *names: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(2, 4, generator=g) for n in names}


def test_head_weight_reads_one_key_from_the_indexed_shard(tmp_path, reads):
    first, second = _tensors(0, "model.embed.weight", "model.norm.weight"), _tensors(1, "model.layer.weight", HEAD)
    save_file(first, tmp_path / "model-00001-of-00002.safetensors")
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(value._head_weight(str(tmp_path), HEAD), second[HEAD])
    assert reads == [("model-00002-of-00002.safetensors", HEAD)]
    reads.clear()
    assert value._head_weight(str(tmp_path), "missing.weight") is None
    assert reads == []


def test_head_weight_reads_one_key_from_a_single_file(tmp_path, reads):
    tensors = _tensors(2, "model.embed.weight", HEAD, "model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    assert torch.equal(value._head_weight(str(tmp_path), HEAD), tensors[HEAD])
    assert value._head_weight(str(tmp_path), "missing.weight") is None
    assert reads == [("model.safetensors", HEAD)]


def _save_on_zero3(path: str) -> dict:
    """Gather and save the embedded policy from ZeRO-3 shards; record what each rank held."""
    import torch.distributed as dist

    from rlhf.config.common import EngineConfig, OptimConfig
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
