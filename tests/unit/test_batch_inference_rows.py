"""batch_inference without a launcher: the post-processors against hand-computed rows, the chunked writer across
interruptions (torn lines included), the config's defaults and refusals, and HF greedy decoding with a repetition
penalty against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_REWARD_MODEL_DIR
from rlhf.config.errors import UsageError
from rlhf.config.flags import flag_specs, parse_config
from rlhf.config.inference_config import BatchInferenceConfig
from rlhf.inference.generate import generated_text, iter_rows
from rlhf.inference.output import ChunkedJsonlWriter, progress_path, split_range
from rlhf.inference.post_process import conditional_sft, iterative_dpo, rejection_sampling, reward_stats

"""24 demo prompts x 2 samples in 4 chunks of 6 prompts."""


# --- post-processors ------------------------------------------------------------------------------

SCORED = [
    {"input": "p1", "output": "a", "reward": 0.5},
    {"input": "p2", "output": "x", "reward": -1.0},
    {"input": "p1", "output": "b", "reward": 2.0},
    {"input": "p1", "output": "c", "reward": -3.0},
    {"input": "p2", "output": "y", "reward": -1.0},
    {"input": "p1", "output": "d", "reward": 2.0},
]


def test_rejection_sampling_keeps_the_first_best_output_per_prompt():
    assert rejection_sampling(SCORED) == [{"input": "p1", "output": "b", "reward": 2.0},
                                          {"input": "p2", "output": "x", "reward": -1.0}]


def test_iterative_dpo_pairs_best_and_worst_per_prompt():
    assert iterative_dpo(SCORED) == [
        {"prompt": "p1", "chosen": "b", "chosen_reward": 2.0, "rejected": "c", "rejected_reward": -3.0},
        # all outputs tie: chosen == rejected == the first, as in OpenRLHF
        {"prompt": "p2", "chosen": "x", "chosen_reward": -1.0, "rejected": "x", "rejected_reward": -1.0},
    ]


def test_conditional_sft_writes_the_reward_into_the_prompt():
    rows = [{"input": "q1", "output": "a", "reward": 1.0}, {"input": "q2", "output": "b", "reward": 3.0},
            {"input": "q3", "output": "c", "reward": 5.0}]
    assert [r["input"] for r in conditional_sft(rows)] == ["q1 <rm_score>: 1.00 ", "q2 <rm_score>: 3.00 ",
                                                           "q3 <rm_score>: 5.00 "]
    # mean 3, unbiased std 2 -> -1, 0, 1; the row keeps the standardised reward
    out = conditional_sft(rows, "[{reward}] {input}", normalize_reward=True)
    assert [(r["input"], r["output"], r["reward"]) for r in out] == [("[-1.00] q1", "a", -1.0), ("[0.00] q2", "b", 0.0),
                                                                     ("[1.00] q3", "c", 1.0)]
    assert rows[0]["input"] == "q1" and rows[0]["reward"] == 1.0  # inputs untouched
    assert reward_stats(rows) == (3.0, 2.0)
    with pytest.raises(ValueError, match="no spread"):
        conditional_sft(rows[:1], normalize_reward=True)


# --- the chunked writer ---------------------------------------------------------------------------

CHUNKS = [[{"input": f"p{c}{i}", "output": "ü " * i, "reward": c + i / 10} for i in range(3)] for c in range(4)]


def _write(path, chunks, fingerprint="f", num_chunks=4):
    writer = ChunkedJsonlWriter(str(path), fingerprint, num_chunks)
    for rows in chunks[writer.resume().chunks_done:]:
        writer.append_chunk(rows)
    return writer


def test_writer_restart_after_a_torn_line_equals_an_uninterrupted_run(tmp_path):
    straight = _write(tmp_path / "straight.jsonl", CHUNKS)
    path = tmp_path / "out.jsonl"
    _write(path, CHUNKS[:1])  # interrupted after the first chunk...
    with open(path, "ab") as f:  # ...while writing the second: a whole row and a torn one are on disk
        f.write((json.dumps(CHUNKS[1][0]) + "\n" + json.dumps(CHUNKS[1][1])[:7]).encode())
    record = json.loads(open(progress_path(str(path))).read())
    assert (record["chunks_done"], record["num_rows"], record["complete"]) == (1, 3, False)
    resumed = _write(path, CHUNKS)
    assert path.read_bytes() == (tmp_path / "straight.jsonl").read_bytes()
    assert resumed.rows() == [row for rows in CHUNKS for row in rows]
    assert resumed.progress == straight.progress
    resumed.mark_complete()
    assert resumed.read_progress().complete


def test_writer_starts_afresh_for_other_inputs_and_refuses_an_edited_file(tmp_path):
    path = tmp_path / "out.jsonl"
    _write(path, CHUNKS[:2])
    assert ChunkedJsonlWriter(str(path), "other inputs", 4).resume().chunks_done == 0
    assert path.read_bytes() == b""  # overwritten, as OpenRLHF overwrites its output
    _write(path, CHUNKS[:2])
    text = path.read_text()
    path.write_text(text.replace("p00", "pXX"))  # same length, other content
    with pytest.raises(UsageError, match="no longer holds the 6 rows"):
        ChunkedJsonlWriter(str(path), "f", 4).resume()
    path.write_text(text[:10])
    with pytest.raises(UsageError, match="delete both files"):
        ChunkedJsonlWriter(str(path), "f", 4).resume()
    path.unlink()  # the output deleted: start afresh
    assert ChunkedJsonlWriter(str(path), "f", 4).resume().chunks_done == 0


def test_split_range_and_iter_rows():
    parts = [split_range(range(10, 17), 3, i) for i in range(3)]
    assert parts == [range(10, 13), range(13, 15), range(15, 17)]
    assert [split_range(range(0, 1), 2, i) for i in range(2)] == [range(0, 1), range(1, 1)]
    assert iter_rows(10, None, 4) == range(10)
    assert iter_rows(10, 2, 4) == range(8, 10)
    with pytest.raises(UsageError, match="--iter 3 x --rollout_batch_size 4 = row 12, past the 10 rows"):
        iter_rows(10, 3, 4)


def test_generated_text_keeps_the_leading_space_and_eos():
    from rlhf.models.loading import load_tokenizer

    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    prompt = tok("q copy 5 :", add_special_tokens=False)["input_ids"]
    answer = tok("5 5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert generated_text(tok, prompt, answer, skip_special_tokens=False) == " 5 5 </s>"
    assert generated_text(tok, prompt, answer, skip_special_tokens=True) == " 5 5"


# --- config ---------------------------------------------------------------------------------------

def parse(*argv: str) -> BatchInferenceConfig:
    return parse_config(BatchInferenceConfig, list(argv), prog="batch_inference")


def test_defaults_are_openrlhfs_and_the_demo_fills_in_the_tiny_model():
    cfg = parse("--eval_task", "generate_vllm", "--output_path", "o.jsonl")
    assert (cfg.seed, cfg.model.value_head_prefix, cfg.engine.zero_stage, cfg.data.max_len, cfg.data.input_key,
            cfg.data.output_key, cfg.generation.prompt_max_len, cfg.generation.max_new_tokens,
            cfg.generation.rollout_batch_size, cfg.scoring.micro_batch_size, cfg.generation.csft_prompt) == \
        (1234, "value_head", 0, 2048, "input", "output", 1024, 1024, 2048, 16, "<rm_score>: 5.00")
    demo = cfg.with_demo_defaults()
    assert demo.model.pretrain == EMBEDDED_MODEL_DIR and demo.data.input_template == "{} "
    assert (demo.generation.prompt_max_len, demo.generation.max_new_tokens) == (32, 8)
    rm = parse("--eval_task", "rm", "--output_path", "o.jsonl", "--max_len", "100").with_demo_defaults()
    assert rm.model.pretrain == EMBEDDED_REWARD_MODEL_DIR and rm.data.max_len == 100
    specs = flag_specs(BatchInferenceConfig)
    names = [s.flag for s in specs]
    assert len(names) == len(set(names)) and all(s.help for s in specs)
    assert not set(names) & set(BatchInferenceConfig.PENDING_FLAGS)


@pytest.mark.parametrize("argv,message", [
    ([], "--eval_task None: choose generate_vllm"),
    (["--eval_task", "rm"], "--output_path is required"),
    (["--eval_task", "rm", "--output_path", "o", "--zero_stage", "3"], "pass --zero_stage 0"),
    (["--eval_task", "generate", "--output_path", "o", "--tp_size", "2"], "needs --eval_task generate_vllm"),
    (["--eval_task", "generate_vllm", "--output_path", "o", "--greedy_sampling", "--best_of_n", "4"],
     "--best_of_n 4 identical samples"),
    (["--eval_task", "rm", "--output_path", "o", "--post_processor", "best"], "choose rs, csft, iter_dpo"),
    (["--eval_task", "rm", "--output_path", "o", "--reward_template", "{input}"], "must contain {input} and"),
    (["--eval_task", "rm", "--output_path", "o", "--lora_rank", "8"], "merge an adapter into its base model"),
])
def test_bad_flag_combinations_name_the_fix(argv, message):
    with pytest.raises(UsageError, match=message.replace("{", r"\{").replace("}", r"\}")):
        parse(*argv)


def test_pretrain_without_dataset_is_refused_and_use_ms_is_noted(capsys):
    cfg = parse("--eval_task", "generate", "--output_path", "o", "--pretrain", EMBEDDED_MODEL_DIR)
    with pytest.raises(UsageError, match="--dataset is not: name the input rows"):
        cfg.with_demo_defaults()
    with pytest.warns(UserWarning, match="--use_ms is ignored: models and datasets are read from local paths only"):
        parse("--eval_task", "generate_vllm", "--output_path", "o", "--use_ms")
    with pytest.warns(UserWarning, match="ignored with --eval_task generate: --post_processor"):
        parse("--eval_task", "generate", "--output_path", "o", "--post_processor", "rs")


def test_hf_engine_greedy_with_repetition_penalty_matches_transformers():
    from transformers import AutoModelForCausalLM

    from rlhf.engines.hf_engine import HFGenerateEngine
    from rlhf.engines.rollout import SamplingSpec
    from rlhf.models.loading import load_tokenizer

    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    engine = HFGenerateEngine(EMBEDDED_MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"),
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, dtype=torch.float32).eval()
    prompts = [tok(f"q copy {d} : ", add_special_tokens=False)["input_ids"] for d in (3, 7)]
    for penalty in (1.0, 5.0):
        spec = SamplingSpec(n=1, temperature=0.0, top_p=1.0, max_tokens=8, repetition_penalty=penalty)
        got = [g[0].token_ids for g in engine.generate(prompts, spec, seeds=[1, 2])]
        with torch.no_grad():
            want = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, repetition_penalty=penalty,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
                    for p in prompts]
        want = [w[:w.index(tok.eos_token_id) + 1] if tok.eos_token_id in w else w for w in want]
        assert got == want, penalty
