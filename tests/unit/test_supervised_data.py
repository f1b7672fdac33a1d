"""Supervised samples on the tiny word-level tokenizer, with token ids and masks derived by hand.

Ids used below: <pad> 0, <unk> 1, </s> 3, copy 4, ":" 5, user 6, assistant 7, digit d -> 9 + d,
letter a 19, b 20, w0 45, w1 46, w2 47. The tiny chat template renders a conversation as
"user : ... assistant : ... " and a generation prompt as "assistant :".
"""

import json

import pytest
import torch

from rlhf.assets import (
    EMBEDDED_MODEL_DIR,
    EMBEDDED_PAIRS_EVAL,
    EMBEDDED_PRM_EVAL,
    EMBEDDED_PRM_PLACEHOLDER,
    EMBEDDED_PRM_REWARD_TOKENS,
    EMBEDDED_SFT_EVAL,
)
from rlhf.data.sources import Row, read_rows
from rlhf.data.supervised_samples import (
    IGNORE_INDEX,
    PairBatch,
    PRMBatch,
    SFTBatch,
    load_pair_samples,
    load_prm_samples,
    load_sft_samples,
)
from rlhf.models.loading import load_tokenizer

EOS, COPY, COLON, USER, ASSISTANT, A, B, W0 = 3, 4, 5, 6, 7, 19, 20, 45


def d(digit):
    return 9 + digit


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


def rows(*datas, source="d.jsonl"):
    return [Row(source, i, data) for i, data in enumerate(datas, 1)]


def sft(tok, data_rows, **kw):
    args = dict(input_key="input", output_key="output", input_template=None, apply_chat_template=False,
                multiturn=False, pretrain_mode=False, max_len=64)
    args.update(kw)
    return load_sft_samples(data_rows, tok, **args)


def mask_of(sample):
    return sample.loss_mask.int().tolist()


# --- SFT ------------------------------------------------------------------------------------------


def test_sft_plain_with_input_template(tok):
    (sample,), report = sft(tok, rows({"input": "copy 7 :", "output": "7 7"}), input_template="{} ")
    assert sample.input_ids.tolist() == [COPY, d(7), COLON, d(7), d(7), EOS]
    assert mask_of(sample) == [0, 0, 1, 1, 1]  # targets: 7 7 </s>
    assert (report.num_samples, report.num_truncated, report.skipped) == (1, 0, {})
    (sample,), _ = sft(tok, rows({"input": "copy 7 :", "output": "7 7"}), input_template="user : {} assistant : ")
    assert sample.input_ids.tolist() == [USER, COLON, COPY, d(7), COLON, ASSISTANT, COLON, d(7), d(7), EOS]
    assert mask_of(sample) == [0] * 6 + [1, 1, 1]


def test_sft_chat_template_from_columns_or_message_list(tok):
    expected_ids = [USER, COLON, COPY, d(7), COLON, ASSISTANT, COLON, d(7), d(7), EOS]
    (a,), _ = sft(tok, rows({"input": "copy 7 :", "output": "7 7"}), apply_chat_template=True)
    messages = [{"role": "user", "content": "copy 7 :"}, {"role": "assistant", "content": "7 7"}]
    (b,), _ = sft(tok, rows({"input": messages}), apply_chat_template=True, output_key=None)
    for sample in (a, b):
        assert sample.input_ids.tolist() == expected_ids
        assert mask_of(sample) == [0] * 6 + [1, 1, 1]


def test_sft_tokenizer_chat_template_overrides_without_changing_the_tokenizer(tok):
    before = tok.chat_template
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (sample,), _ = sft(tok, rows({"input": "copy 7 :", "output": "7 7"}), apply_chat_template=True,
                       tokenizer_chat_template=template)
    assert sample.input_ids.tolist() == [COPY, d(7), COLON, d(7), d(7), EOS]
    assert mask_of(sample) == [0, 0, 1, 1, 1]
    assert tok.chat_template == before


def test_sft_multiturn_masks_every_assistant_turn(tok):
    messages = [{"role": "user", "content": "copy 1 :"}, {"role": "assistant", "content": "1 1"},
                {"role": "user", "content": "copy 2 :"}, {"role": "assistant", "content": "2 2"}]
    (sample,), _ = sft(tok, rows({"input": messages}), apply_chat_template=True, output_key=None, multiturn=True)
    turn = lambda digit: [USER, COLON, COPY, d(digit), COLON, ASSISTANT, COLON, d(digit), d(digit)]  # noqa: E731
    assert sample.input_ids.tolist() == turn(1) + turn(2) + [EOS]
    # targets: tokens 7, 8 (first answer) and 16, 17, 18 (second answer and the EOS)
    assert mask_of(sample) == [0] * 6 + [1, 1] + [0] * 7 + [1, 1, 1]
    # one turn: the same mask as plain chat-template SFT
    (single,), _ = sft(tok, rows({"input": messages[:2]}), apply_chat_template=True, output_key=None, multiturn=True)
    (plain,), _ = sft(tok, rows({"input": messages[:2]}), apply_chat_template=True, output_key=None)
    assert single.input_ids.tolist() == plain.input_ids.tolist() and mask_of(single) == mask_of(plain)


def test_sft_empty_conversation_is_skipped(tok):
    messages = [{"role": "user", "content": "copy 1 :"}, {"role": "assistant", "content": "1"}]
    data = rows({"input": []}, {"input": messages}, {"input": messages[:1] + [{"role": "assistant"}]})
    with pytest.warns(UserWarning, match=r"2 SFT samples from 3 rows; skipped 1 \(empty prompt\): d.jsonl, row 1"):
        samples, report = sft(tok, data, apply_chat_template=True, output_key=None, multiturn=True)
    assert [s.where for s in samples] == ["d.jsonl, row 2", "d.jsonl, row 3"]
    assert sum(map(len, report.skipped.values())) == 1
    # an answer without content renders as whitespace: as in OpenRLHF it is kept, and only its EOS is a target
    assert samples[1].input_ids.tolist() == [USER, COLON, COPY, d(1), COLON, ASSISTANT, COLON, EOS]
    assert mask_of(samples[1]) == [0] * 6 + [1]


def test_sft_pretrain_mode_uses_every_token_of_the_raw_text(tok):
    (sample,), _ = sft(tok, rows({"input": "copy 7 : 7 7"}), pretrain_mode=True, output_key=None,
                       input_template="user : {}", apply_chat_template=True)
    assert sample.input_ids.tolist() == [COPY, d(7), COLON, d(7), d(7)]  # no template, no EOS
    assert mask_of(sample) == [1, 1, 1, 1]


def test_sft_truncation_keeps_eos_and_long_prompts_are_dropped(tok):
    data = rows({"input": "copy 7 :", "output": "7 7 7 7"}, {"input": "a b copy 7 :", "output": "7"})
    with pytest.warns(UserWarning, match=r"1 SFT samples from 2 rows; 1 cut to max_len tokens; skipped 1 \(prompt "
                                         r"of max_len - 2 = 4 tokens or more\): d.jsonl, row 2"):
        (sample,), report = sft(tok, data, input_template="{} ", max_len=6)
    assert sample.input_ids.tolist() == [COPY, d(7), COLON, d(7), d(7), EOS]
    assert mask_of(sample) == [0, 0, 1, 1, 1]
    assert report.num_truncated == 1
    assert report.skipped == {"prompt of max_len - 2 = 4 tokens or more": ["d.jsonl, row 2"]}
    with pytest.raises(ValueError, match=r"no usable SFT samples: 0 SFT samples from 2 rows; skipped 2 \(prompt of "
                                         r"max_len - 2 = 1 tokens or more\): d.jsonl, row 1; d.jsonl, row 2"):
        sft(tok, data, input_template="{} ", max_len=3)


def test_sft_missing_key_names_key_file_row_and_columns(tok):
    data = rows({"input": "copy 1 :", "output": "1"}, {"question": "copy 2 :", "answer": "2"})
    with pytest.raises(ValueError, match=r"d.jsonl, row 2: no column 'input' \(columns: answer, question\); "
                                         r"pass the right one with --input_key"):
        sft(tok, data, input_template="{} ")
    with pytest.raises(ValueError, match=r"d.jsonl, row 1: no column 'response' .*--output_key"):
        sft(tok, data, output_key="response")


def test_sft_flag_combinations(tok):
    data = rows({"input": "copy 1 :", "output": "1"})
    with pytest.raises(ValueError, match="--multiturn needs --apply_chat_template"):
        sft(tok, data, multiturn=True)
    with pytest.raises(ValueError, match="needs --output_key"):
        sft(tok, data, output_key=None)
    with pytest.raises(ValueError, match=r"--input_template 'User: ' has no \{\}"):
        sft(tok, data, input_template="User: ")
    with pytest.raises(ValueError, match=r"d.jsonl, row 1: column 'input' holds str; .*message list"):
        sft(tok, data, apply_chat_template=True, output_key=None)


# --- pairs ----------------------------------------------------------------------------------------


def pairs(tok, data_rows, **kw):
    args = dict(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", margin_key=None,
                input_template="{} ", apply_chat_template=False, max_len=64)
    args.update(kw)
    return load_pair_samples(data_rows, tok, **args)


def test_pairs_join_prompt_and_response_and_end_in_eos(tok):
    (sample,), report = pairs(tok, rows({"prompt": "copy 7 :", "chosen": "7 7", "rejected": "a b", "margin": 0.5}),
                              margin_key="margin")
    assert sample.chosen_ids.tolist() == [COPY, d(7), COLON, d(7), d(7), EOS]
    assert sample.rejected_ids.tolist() == [COPY, d(7), COLON, A, B, EOS]
    assert sample.margin == 0.5 and report.num_samples == 1
    (no_margin,), _ = pairs(tok, rows({"prompt": "copy 7 :", "chosen": "7 7", "rejected": "a b"}))
    assert no_margin.margin is None


def test_pairs_with_chat_template_and_without_prompt_key(tok):
    conversation = lambda answer: [{"role": "user", "content": "copy 7 :"},  # noqa: E731
                                   {"role": "assistant", "content": answer}]
    (sample,), _ = pairs(tok, rows({"chosen": conversation("7"), "rejected": conversation("a")}), prompt_key=None,
                         apply_chat_template=True)
    head = [USER, COLON, COPY, d(7), COLON, ASSISTANT, COLON]
    assert sample.chosen_ids.tolist() == head + [d(7), EOS]
    assert sample.rejected_ids.tolist() == head + [A, EOS]
    (same,), _ = pairs(tok, rows({"prompt": "copy 7 :", "chosen": "7", "rejected": "a"}), apply_chat_template=True)
    assert same.chosen_ids.tolist() == sample.chosen_ids.tolist()


def test_degenerate_pairs_are_skipped_and_reported(tok):
    data = rows({"prompt": "copy 7 :", "chosen": "7 7", "rejected": "a b"},
                {"prompt": "copy 7 :", "chosen": "7 7", "rejected": "7 7"},
                {"prompt": "copy 7 :", "chosen": "7", "rejected": ""},
                {"prompt": "copy 7 :", "chosen": "7 7 a", "rejected": "7 7 b"},
                {"prompt": "copy 7 :", "chosen": "7 a a", "rejected": "7 b"})
    with pytest.warns(UserWarning, match=r"2 pairs from 5 rows; 1 cut to max_len tokens; skipped 1 \(identical chosen "
                                         r"and rejected\): d.jsonl, row 2; skipped 1 \(empty chosen or rejected\): "
                                         r"d.jsonl, row 3; skipped 1 \(identical after the cut to max_len\): d.jsonl, "
                                         r"row 4"):
        samples, report = pairs(tok, data, max_len=6)
    assert [s.where for s in samples] == ["d.jsonl, row 1", "d.jsonl, row 5"]
    assert samples[1].chosen_ids.tolist() == [COPY, d(7), COLON, d(7), A, EOS]
    assert sum(map(len, report.skipped.values())) == 3
    with pytest.raises(ValueError, match=r"no usable pairs: 0 pairs from 3 rows; skipped 1"):
        pairs(tok, data[1:4], max_len=6)


def test_pairs_missing_keys(tok):
    with pytest.raises(ValueError, match=r"d.jsonl, row 1: no column 'rejected' \(columns: chosen, prompt\); pass the "
                                         r"right one with --rejected_key"):
        pairs(tok, rows({"prompt": "copy 7 :", "chosen": "7"}))
    with pytest.raises(ValueError, match=r"row 1: no column 'margin'"):
        pairs(tok, rows({"prompt": "copy 7 :", "chosen": "7", "rejected": "a"}), margin_key="margin")


# --- PRM ------------------------------------------------------------------------------------------


def prm(tok, data_rows, **kw):
    args = dict(input_key="input", label_key="label", placeholder_token="w0", reward_tokens=["w1", "w2"], max_len=64)
    args.update(kw)
    return load_prm_samples(data_rows, tok, **args)


def test_prm_hard_and_soft_labels_at_placeholder_positions(tok):
    (hard,), _ = prm(tok, rows({"input": "copy 7 : 7 w0 a w0", "label": ["w1", "w2"]}))
    assert hard.input_ids.tolist() == [COPY, d(7), COLON, d(7), W0, A, W0]
    assert hard.positions.tolist() == [4, 6] and hard.labels.tolist() == [0, 1]
    assert hard.labels.dtype == torch.int64
    (soft,), _ = prm(tok, rows({"input": "copy 7 : 7 w0 a w0", "label": [0.75, 0.25]}))
    assert soft.labels.dtype == torch.float32 and soft.labels.tolist() == [0.75, 0.25]
    (vocab,), _ = prm(tok, rows({"input": "copy 7 : 7 w0", "label": ["w1"]}), reward_tokens=None)
    assert vocab.labels.tolist() == [46]  # without --reward_tokens: the label's token id, as OpenRLHF


def test_prm_truncation_cuts_labels_with_their_placeholders(tok):
    data = rows({"input": "copy 7 : 7 w0 a w0", "label": ["w1", "w2"]}, {"input": "copy 7 : a b w0", "label": ["w2"]})
    with pytest.warns(UserWarning, match=r"skipped 1 \(no placeholder within max_len\): d.jsonl, row 2"):
        (sample,), report = prm(tok, data, max_len=5)
    assert sample.input_ids.tolist() == [COPY, d(7), COLON, d(7), W0]
    assert sample.positions.tolist() == [4] and sample.labels.tolist() == [0]
    assert report.num_truncated == 2


def test_prm_errors_name_row_and_flag(tok):
    ok = {"input": "copy 7 : 7 w0", "label": ["w1"]}
    with pytest.raises(ValueError, match=r"--placeholder_token 'zz' is not a single token of the tokenizer"):
        prm(tok, rows(ok), placeholder_token="zz")
    with pytest.raises(ValueError, match=r"--placeholder_token 'w0 w1' is not a single token"):
        prm(tok, rows(ok), placeholder_token="w0 w1")
    with pytest.raises(ValueError, match=r"--reward_tokens '\+' is not a single token"):
        prm(tok, rows(ok), reward_tokens=["+", "-"])
    with pytest.raises(ValueError, match=r"d.jsonl, row 2: 1 labels in column 'label' but 2 placeholders 'w0'"):
        prm(tok, rows(ok, {"input": "copy 7 : 7 w0 7 w0", "label": ["w1"]}))
    with pytest.raises(ValueError, match=r"d.jsonl, row 1: label 'w3' is not one of --reward_tokens w1 w2"):
        prm(tok, rows({"input": "copy 7 : 7 w0", "label": ["w3"]}))
    with pytest.raises(ValueError, match=r"row 1: numeric \(soft\) labels need exactly two --reward_tokens"):
        prm(tok, rows({"input": "copy 7 : 7 w0", "label": [0.5]}), reward_tokens=None)
    with pytest.raises(ValueError, match=r"d.jsonl, row 2: soft labels, but d.jsonl, row 1 has the other kind"):
        prm(tok, rows(ok, {"input": "copy 7 : 7 w0", "label": [1.0]}))
    with pytest.raises(ValueError, match=r"row 1: no column 'steps' \(columns: input, label\).*--label_key"):
        prm(tok, rows(ok), label_key="steps")


# --- batches --------------------------------------------------------------------------------------


def test_sft_batch_collate_select_trim(tok):
    data = rows({"input": "copy 7 :", "output": "7 7 7"}, {"input": "copy 1 :", "output": "1"})
    samples, _ = sft(tok, data, input_template="{} ")
    batch = SFTBatch.collate(samples, pad_id=0)
    assert batch.input_ids_BT.tolist() == [[COPY, d(7), COLON, d(7), d(7), d(7), EOS],
                                           [COPY, d(1), COLON, d(1), EOS, 0, 0]]
    assert batch.attention_mask_BT.tolist() == [[1] * 7, [1] * 5 + [0, 0]]
    assert batch.loss_mask_BT1.dtype == torch.float32
    assert batch.loss_mask_BT1.tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert batch.num_samples == 2
    second = batch.select(torch.tensor([1]))
    assert second.num_samples == 1 and second.input_ids_BT.shape == (1, 7)
    trimmed = second.trimmed()
    assert trimmed.input_ids_BT.tolist() == [[COPY, d(1), COLON, d(1), EOS]]
    assert trimmed.loss_mask_BT1.tolist() == [[0, 0, 1, 1]]
    assert batch.trimmed().input_ids_BT.shape == (2, 7)


def test_pair_batch_layout(tok):
    data = rows({"prompt": "copy 7 :", "chosen": "7 7 7", "rejected": "a", "margin": 1},
                {"prompt": "copy 1 :", "chosen": "1", "rejected": "a b", "margin": 0.25})
    samples, _ = pairs(tok, data, margin_key="margin")
    batch = PairBatch.collate(samples, pad_id=0)
    assert batch.chosen_ids_BT.shape == batch.rejected_ids_BT.shape == (2, 7)
    assert batch.rejected_ids_BT[0].tolist() == [COPY, d(7), COLON, A, EOS, 0, 0]
    assert batch.margins_B.tolist() == [1.0, 0.25]
    ids_2BT, mask_2BT = batch.concatenated()
    assert ids_2BT[2].tolist() == batch.rejected_ids_BT[0].tolist() and mask_2BT.shape == (4, 7)
    last = batch.chosen_mask_BT.sum(-1) - 1
    assert batch.chosen_ids_BT.gather(1, last[:, None]).flatten().tolist() == [EOS, EOS]
    second = batch.select(torch.tensor([False, True])).trimmed()
    assert second.chosen_ids_BT.tolist() == [[COPY, d(1), COLON, d(1), EOS, 0]]
    assert second.rejected_ids_BT.tolist() == [[COPY, d(1), COLON, A, B, EOS]]
    assert second.margins_B.tolist() == [0.25]
    no_margins = PairBatch.collate(pairs(tok, data)[0], pad_id=0)
    assert no_margins.margins_B is None and no_margins.select(slice(0, 1)).margins_B is None


def test_prm_batch_labels_only_at_placeholders(tok):
    data = rows({"input": "copy 7 : 7 w0 a w0", "label": ["w1", "w2"]}, {"input": "copy 1 : b w0", "label": ["w2"]})
    samples, _ = prm(tok, data)
    batch = PRMBatch.collate(samples, pad_id=0)
    X = IGNORE_INDEX
    assert batch.labels_BT.tolist() == [[X, X, X, X, 0, X, 1], [X, X, X, X, 1, X, X]]
    assert batch.label_mask_BT.tolist() == [[False] * 4 + [True, False, True], [False] * 4 + [True, False, False]]
    assert batch.input_ids_BT[1].tolist() == [COPY, d(1), COLON, B, W0, 0, 0]
    trimmed = batch.select(torch.tensor([1])).trimmed()
    assert trimmed.labels_BT.tolist() == [[X, X, X, X, 1]] and trimmed.attention_mask_BT.tolist() == [[1] * 5]


# --- the embedded copy-task data ------------------------------------------------------------------


def read_file(path):
    return read_rows(path, probs=None, split="train", max_samples=10**6, seed=0, flag="--dataset")


def test_embedded_data_loads_without_skips(tok):
    sft_samples, report = sft(tok, read_file(EMBEDDED_SFT_EVAL), apply_chat_template=True)
    assert report.num_samples == report.num_rows == len(sft_samples) > 0
    pair_samples, report = pairs(tok, read_file(EMBEDDED_PAIRS_EVAL), margin_key="margin")
    assert report.num_samples == report.num_rows and report.num_truncated == 0
    prm_samples, report = prm(tok, read_file(EMBEDDED_PRM_EVAL), placeholder_token=EMBEDDED_PRM_PLACEHOLDER,
                              reward_tokens=list(EMBEDDED_PRM_REWARD_TOKENS))
    assert report.num_samples == report.num_rows and all(len(s.positions) == 4 for s in prm_samples)


def copies(prompt, answer):
    digit = prompt.split()[-2]
    return sum(word == digit for word in answer.split()[:4])


def test_embedded_data_follows_the_copy_rule():
    with open(EMBEDDED_PAIRS_EVAL) as f:
        pair_rows = [json.loads(line) for line in f]
    assert all(copies(r["prompt"], r["chosen"]) > copies(r["prompt"], r["rejected"]) for r in pair_rows)
    with open(EMBEDDED_PRM_EVAL) as f:
        for line in f:
            row = json.loads(line)
            digit = row["input"].split(":")[0].split()[-1]
            steps = row["input"].split(":", 1)[1].split()[::2]
            assert row["label"] == ["w1" if s == digit else "w2" for s in steps]
    with open(EMBEDDED_SFT_EVAL) as f:
        assert all(copies(r["input"], r["output"]) == 4 for r in map(json.loads, f))
