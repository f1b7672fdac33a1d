"""Throughput metrics by hand: the FLOPs of a tiny Llama (N counted from its weights, the input embedding left
out), the sequence lengths of padded and packed inputs, the forward hook's count inside a step (training and
forward-only, nothing outside a step; a value-head model too), generation's count, and the per-step metrics with
and without a peak."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.core import throughput
from rlhf.core.throughput import ModelShape, Throughput, count_generated, count_work, sequence_lengths
from rlhf.models.value import ScalarHeadModel
from rlhf.utils import watchdog

TINY = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, max_position_embeddings=32)
# per layer: q, k, v, o 4 x 8 x 8 = 256; gate, up, down 3 x 8 x 16 = 384; two norms 16 -> 656; two layers 1312;
# final norm 8; lm_head 8 x 16 = 128 (not tied); the input embedding (128) is left out
N = 1312 + 8 + 128


@pytest.fixture
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(TINY)


def test_model_shape_and_flops_by_hand(model):
    shape = ModelShape.of(model)
    assert shape == ModelShape(N, 2, 8)
    lengths = torch.tensor([3, 5])
    assert shape.flops(lengths, training=True) == 6 * N * 8 + 12 * 2 * 8 * (9 + 25)
    assert shape.flops(lengths, training=False) == 2 * N * 8 + 4 * 2 * 8 * (9 + 25)
    tied = LlamaForCausalLM(LlamaConfig(**{**TINY.to_dict(), "tie_word_embeddings": True}))
    assert ModelShape.of(tied).params == N  # the output projection still computes
    # a critic or reward model: the backbone without lm_head (128), plus its value head (8 x 1)
    assert ModelShape.of(ScalarHeadModel(model.model, "value_head")) == ModelShape(N - 128 + 8, 2, 8)


def test_sequence_lengths_of_padded_packed_and_plain_inputs():
    ids = torch.zeros(2, 6, dtype=torch.long)
    assert sequence_lengths(ids, torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6]), None).tolist() == [3, 6]
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert sequence_lengths(torch.zeros(1, 6, dtype=torch.long), None, packed).tolist() == [3, 2, 1]
    assert sequence_lengths(ids, None, None).tolist() == [6, 6]


def test_the_hook_counts_forwards_inside_a_step_only(model):
    count_work(model, "policy")
    throughput.WORK.pop()
    ids, mask = torch.ones(2, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 0, 0], [1] * 5])
    model(input_ids=ids, attention_mask=mask)  # setup or evaluation: not counted
    assert throughput.WORK.pop() == ({}, 0.0, 0.0)
    shape = ModelShape.of(model)
    with watchdog.stage("step"):
        with watchdog.stage("experience"), torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        with watchdog.stage("train"):
            model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        with watchdog.stage("generation"):
            count_generated(shape, torch.tensor([7, 9]), generated_tokens=10.0)
    flops, trained, generated = throughput.WORK.pop()
    lengths = torch.tensor([3, 5])
    assert flops == {"experience": shape.flops(lengths, False), "train": shape.flops(lengths, True),
                     "generation": shape.flops(torch.tensor([7, 9]), False)}
    assert (trained, generated) == (8.0, 10.0)


def test_step_metrics_by_hand():
    throughput.WORK.pop()
    throughput.WORK.add(3e12, "train")
    throughput.WORK.add(1e12, "generation")
    throughput.WORK.trained_tokens, throughput.WORK.generated_tokens = 4000.0, 500.0
    times = {"time/step": 2.0, "time/train": 1.5, "time/generation": 0.25}
    assert Throughput(peak=4.0).metrics(times) == {
        "perf/tokens_per_s": 2000.0, "perf/tflops": 2.0, "perf/mfu": 0.5, "perf/generation_tflops": 4.0,
        "perf/train_tflops": 2.0, "perf/generated_tokens_per_s": 2000.0}
    assert "perf/mfu" not in Throughput(peak=None).metrics(times)  # no peak (a CPU): no MFU


def test_peak_from_the_flag_or_none_on_cpu():
    assert throughput.device_peak_tflops(torch.device("cpu"), 50.0) == (50.0, "--peak_tflops")
    peak, why = throughput.device_peak_tflops(torch.device("cpu"), None)
    assert peak is None and "pass --peak_tflops" in why


def test_perf_summary_averages_the_steps_after_the_first():
    meter = Throughput(peak=None)
    for step_s, tokens in ((10.0, 100.0), (2.0, 400.0), (4.0, 400.0)):
        throughput.WORK.pop()
        throughput.WORK.trained_tokens = tokens
        meter.metrics({"time/step": step_s})
    assert meter.summary().splitlines() == ["perf: means over 2 step(s) after the first",
                                            f"  {'perf/tflops':<32} 0", f"  {'perf/tokens_per_s':<32} 150",
                                            f"  {'time/step':<32} 3"]


def test_step_profile_counts_the_hosts_reads_of_tensor_values(tmp_path):
    """benchmarks/step_profile.py's summary: each `.item()`/`float()` of a tensor is one host read (on CUDA a
    stall until the device catches up), and the step's wall time and top operators are there."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))
    from step_profile import profiled

    x = torch.randn(64, 64)
    out = tmp_path / "p.json"
    with profiled(str(out)):
        y = x @ x
        total = float(y.sum()) + y.max().item() + float(y.mean())
    summary = json.loads(out.read_text())
    assert total == total and summary["host_reads"] == 3 and summary["syncs"] == 0
    assert summary["wall_ms"] > 0 and summary["device_busy_share"] is None  # no CUDA here
    assert "aten::mm" in {row["op"] for row in summary["top_host_self"]}
