"""batch_inference end to end on the embedded tiny models: HF generate on 2 ranks == a 1-rank run stopped after its
first chunk and rerun, reward-model scores == scoring the rows by hand (with the stored mean/std), vLLM greedy rows
== HF greedy decoding, and vLLM sampled rows do not depend on the rank count."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_PROMPTS, EMBEDDED_REWARD_MODEL_DIR
from rlhf.inference.generate import generated_text
from rlhf.inference.output import progress_path
from rlhf.inference.post_process import rejection_sampling
from tests.distributed import ROOT, assert_clean_output, free_port, run_job_variants
from tests.tiny_runs import EAGER

CPU = ["--param_dtype", "fp32", "--attn_implementation", "sdpa"]
GEN = [*CPU, "--max_samples", "24", "--best_of_n", "2", "--chunk_size", "6"]
"""24 demo prompts x 2 samples in 4 chunks of 6 prompts."""


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


SAMPLED_VLLM = ["--eval_task", "generate_vllm", *GEN, *EAGER, "--tp_size", "1"]


def _scoring_model(tmp) -> str:
    """The embedded reward model with the normalisation train_rm stores in its config."""
    rm = tmp / "rm"
    shutil.copytree(EMBEDDED_REWARD_MODEL_DIR, rm)
    config = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**config, "mean": 0.25, "std": 0.5}))
    return str(rm)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """This file's launched runs, in two launches (`run_job_variants`): on 2 ranks, the demo's first
    24 prompts x 2 samples with HF generate, their rejection sampling by the reward model, 12 greedy rows from
    vLLM and the 24 x 2 sampled by vLLM; on 1 rank, the same greedy rows from HF generate.
    Returns (the directory, each run's console output by name)."""
    tmp = tmp_path_factory.mktemp("batch")
    two = {
        "hf_generated": ["--eval_task", "generate", *GEN, "--output_path", str(tmp / "gen.jsonl")],
        # the head is named in the model's config ("score"): it wins over --value_head_prefix's default
        "rs": ["--eval_task", "rm", *CPU, "--pretrain", _scoring_model(tmp), "--dataset", str(tmp / "gen.jsonl"),
               "--max_len", "64", "--micro_batch_size", "5", "--chunk_size", "16", "--post_processor", "rs",
               "--output_path", str(tmp / "rs.jsonl")],
    }
    one = {}
    if importlib.util.find_spec("vllm") is not None:
        two["vllm_greedy"] = ["--eval_task", "generate_vllm", *CPU, *EAGER, "--tp_size", "1", "--max_samples", "12",
                              "--chunk_size", "5", "--greedy_sampling", "--output_path", str(tmp / "greedy.jsonl"),
                              "--max_num_seqs", "4"]
        two["vllm_sampled"] = [*SAMPLED_VLLM, "--output_path", str(tmp / "two.jsonl")]
        one["hf_greedy"] = ["--eval_task", "generate", *CPU, "--max_samples", "12", "--greedy_sampling",
                            "--output_path", str(tmp / "hf_greedy.jsonl")]
    outputs = {}
    for nproc, named in ((2, two), (1, one)):
        if named:
            texts = run_job_variants(nproc, [("batch_inference", argv) for argv in named.values()],
                                     tmp / f"consoles{nproc}")
            outputs.update(zip(named, texts))
    return tmp, outputs


@pytest.fixture(scope="module")
def hf_generated(runs):
    """The demo's first 24 prompts x 2 samples, HF generate on 2 ranks (uninterrupted)."""
    tmp, outputs = runs
    assert "24 prompts x 2 samples on 2 HF generate engine(s) of 1 rank(s)" in outputs["hf_generated"]
    return tmp / "gen.jsonl"


def _single_rank(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "MASTER_PORT": str(free_port())}
    return subprocess.Popen([sys.executable, "-m", "rlhf.cli.batch_inference", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _chunks_done(path) -> int:
    try:
        with open(progress_path(str(path))) as f:
            return json.load(f)["chunks_done"]
    except (OSError, ValueError, KeyError):
        return 0


def test_generate_rows_and_a_stopped_single_rank_run_resumed_equal_two_ranks(hf_generated, tmp_path):
    rows = _rows(hf_generated)
    assert len(rows) == 48 and all(set(r) == {"input", "output"} for r in rows)
    assert [r["input"] for r in rows[:4]] == ["b i q copy 6 : "] * 2 + ["z j p copy 7 : "] * 2  # samples together
    assert rows[0]["output"] != rows[1]["output"]
    out = tmp_path / "gen.jsonl"
    args = ["--eval_task", "generate", *GEN, "--output_path", str(out)]
    proc = _single_rank(*args)
    # preemption, sent once the run describes itself (its signal handling is in place, no chunk is written yet: a
    # whole run can take less time than a poll for its first chunk): remembered, it stops the run after chunk 1
    before = ""
    while not before.endswith(f"-> {out}\n"):  # the demo line, then the description
        line = proc.stdout.readline()
        assert line, before + proc.stderr.read()[-3000:]
        before += line
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    stdout = before + stdout
    assert proc.returncode == 75, stderr[-6000:]
    assert "rerun the same command to continue" in stdout
    done = _chunks_done(out)
    assert done == 1
    with open(out, "ab") as f:  # and a crash while writing the next chunk left a torn row behind
        f.write(b'{"input": "b i q co')
    proc = _single_rank(*args)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-6000:]
    assert_clean_output(stdout, stderr)
    assert f"resuming {out}: {done} of 4 chunks ({done * 12} rows)" in stdout
    assert out.read_bytes() == hf_generated.read_bytes()


def test_rm_scores_equal_direct_scoring_then_rejection_sampling(runs, hf_generated):
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.value import load_scalar_head_model

    tmp, _ = runs
    rm, out = tmp / "rm", tmp / "rs.jsonl"
    generated = [r for r in _rows(hf_generated) if r["output"]]  # OpenRLHF's SFTDataset drops empty responses
    scored = _rows(str(out) + ".scored.jsonl")
    assert [(r["input"], r["output"]) for r in scored] == [(r["input"], r["output"]) for r in generated]
    tok = load_tokenizer(str(rm))
    model = load_scalar_head_model(str(rm), "score", torch.float32, "sdpa").eval()
    for row in scored:
        ids = tok((row["input"] + row["output"]).rstrip("\n") + " </s>", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            raw = float(model(torch.tensor([ids]))[0, -1])
        assert row["reward"] == pytest.approx((raw - 0.25) / 0.5, rel=1e-5, abs=1e-6)
    assert _rows(out) == rejection_sampling(scored)
    assert len(_rows(out)) == len({r["input"] for r in generated})


@pytest.mark.vllm
def test_vllm_greedy_rows_equal_hf_greedy_decoding(runs):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from rlhf.models.loading import load_tokenizer

    tmp, outputs = runs
    out, hf_out = tmp / "greedy.jsonl", tmp / "hf_greedy.jsonl"
    assert "12 prompts x 1 sample on 2 vLLM engine(s) of 1 rank(s)" in outputs["vllm_greedy"]
    rows = _rows(out)
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, dtype=torch.float32).eval()
    prompts = [row["input"] + " " for row in _rows(EMBEDDED_PROMPTS)[:12]]  # the demo template "{} "
    assert [r["input"] for r in rows] == prompts
    for row in rows:
        ids = tok(row["input"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert row["output"] == generated_text(tok, ids, seq, skip_special_tokens=False), row
    for row, hf_row in zip(rows, _rows(hf_out), strict=True):  # the HF engine decodes greedily too
        ids = tok(row["input"], add_special_tokens=False)["input_ids"]
        seq = tok(row["input"] + row["output"], add_special_tokens=False)["input_ids"][len(ids):]
        assert hf_row["output"] == generated_text(tok, ids, seq, skip_special_tokens=True), (row, hf_row)


@pytest.mark.vllm
def test_vllm_sampled_rows_do_not_depend_on_the_rank_count(runs, tmp_path):
    """2 ranks under torchrun (in `runs`) and 1 rank without a launcher write the same bytes."""
    pytest.importorskip("vllm")
    two = runs[0] / "two.jsonl"
    one = _single_rank(*SAMPLED_VLLM, "--output_path", str(tmp_path / "one.jsonl"))
    stdout, stderr = one.communicate(timeout=600)
    assert one.returncode == 0, stderr[-6000:]
    assert_clean_output(stdout, stderr)
    assert (tmp_path / "one.jsonl").read_bytes() == two.read_bytes()
