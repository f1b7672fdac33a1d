"""Tokenised samples and typed batches of the supervised jobs: SFT, reward model (pairs), process reward
model. Rows come from `sources.read_rows`, texts from `formatting`; this module owns tokenisation,
truncation, loss masks and padding, and knows nothing of models, losses or process groups.

Shape legend (as in `records`): B samples (pairs in `PairBatch`), T token positions, right-padded with
the pad id; T1 = T - 1 next-token positions (index t scores token t + 1).

Matched to OpenRLHF v0.9.5:
- SFT (`SFTDataset`): the text is `(prompt + response).rstrip("\\n")`, plus `" " + EOS` unless it already
  ends with EOS; tokenised without special tokens, cut to `max_len` with its last token forced to EOS.
  Rows with an empty prompt or response, or a prompt of `max_len - 2` tokens or more, are dropped (and
  counted). The loss covers the response tokens and that EOS. `--pretrain_mode`: the raw input text (no
  template, no EOS), cut to `max_len`, every token a target. `--multiturn`: every assistant turn, each
  located by tokenising the conversation before it (OpenRLHF's response ranges); unlike OpenRLHF, an EOS
  appended after a final assistant turn is a target too, so a one-turn conversation gets the same mask
  as plain chat-template SFT.
- Pairs (`RewardDataset`): prompt + chosen and prompt + rejected get the same EOS and cut, so a reward
  read at the last real token reads the EOS. OpenRLHF pads pairs on the left; here they are
  right-padded (find the last token with the attention mask). OpenRLHF keeps degenerate pairs; here
  identical, empty, or identical-after-truncation pairs are skipped and counted.
- PRM (`ProcessRewardDataset`): the raw input cut to `max_len` (no EOS); labels sit at the placeholder
  positions and are cut to the placeholders that survive the cut.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rlhf.algorithms.sft_loss import assistant_loss_mask_T1
from rlhf.data.formatting import (
    ChatTemplate,
    as_messages,
    as_text,
    assistant_turns,
    check_input_template,
    conversation_text,
    make_chat_template,
    prompt_text,
    response_text,
    split_last_turn,
)
from rlhf.data.records import TokenBatch
from rlhf.data.sources import Row

IGNORE_INDEX = -100  # label of PRM positions that are not placeholders (torch cross-entropy's default)


# --- samples and the load report -----------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SFTSample:
    """input_ids: int64 [T]. loss_mask: bool [T - 1], true where token t + 1 is a target."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    where: str


@dataclass(frozen=True, eq=False)
class PairSample:
    """chosen_ids / rejected_ids: int64 [Tc] / [Tr], prompt + response ending in EOS. margin: the row's
    margin (None without a margin column). prompt_len: the prompt's tokens at the start of both (0 when the
    columns hold whole conversations)."""

    chosen_ids: torch.Tensor
    rejected_ids: torch.Tensor
    margin: float | None
    where: str
    prompt_len: int = 0


@dataclass(frozen=True, eq=False)
class UnpairedSample:
    """One labelled response (KTO): `sft.input_ids` prompt + response + EOS, `sft.loss_mask` on the response
    and EOS. desirable: the label. pair: the index of the preference pair it came from (None for unpaired
    rows), so held-out pairs can be compared."""

    sft: SFTSample
    desirable: bool
    pair: int | None = None

    @property
    def prompt_len(self) -> int:
        return int(self.sft.loss_mask.nonzero()[0]) + 1


@dataclass(frozen=True, eq=False)
class PRMSample:
    """input_ids: int64 [T]. positions: int64 [K] ascending positions of the placeholder tokens.
    labels: [K], int64 class indices (hard labels) or float32 probabilities of `reward_tokens[0]`
    (soft labels)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    where: str


@dataclass
class LoadReport:
    """What a loader did with its rows: samples made, samples cut to `max_len`, rows skipped by reason
    (each with the `FILE, row N` of every skipped row)."""

    what: str
    num_rows: int = 0
    num_samples: int = 0
    num_truncated: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped.setdefault(reason, []).append(where)

    def summary(self) -> str:
        text = f"{self.num_samples} {self.what} from {self.num_rows} rows"
        if self.num_truncated:
            text += f"; {self.num_truncated} cut to max_len tokens"
        for reason, wheres in self.skipped.items():
            more = f", ... ({len(wheres)} in all)" if len(wheres) > 3 else ""
            text += f"; skipped {len(wheres)} ({reason}): {'; '.join(wheres[:3])}{more}"
        return text


def _finish(samples: list, report: LoadReport, flag: str) -> tuple[list, LoadReport]:
    report.num_samples = len(samples)
    if not samples:
        raise ValueError(f"no usable {report.what}: {report.summary()}; check {flag} and --max_len")
    if report.skipped or report.num_truncated:
        warnings.warn(report.summary(), stacklevel=3)
    return samples, report


# --- shared helpers -------------------------------------------------------------------------------


def column(row: Row, key: str, flag: str) -> Any:
    """`row`'s column `key`, or a ValueError naming the file, row, the columns present and `flag`."""
    if key not in row.data:
        raise ValueError(f"{row.where}: no column {key!r} (columns: {', '.join(sorted(row.data))}); "
                         f"pass the right one with {flag}")
    return row.data[key]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_max_len(max_len: int, least: int) -> None:
    if max_len < least:
        raise ValueError(f"--max_len {max_len}: must be at least {least}")


def _eos(tokenizer) -> tuple[str, int]:
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token, which supervised samples end with; use a tokenizer "
                         "that defines one")
    return tokenizer.eos_token, tokenizer.eos_token_id


def _encode_with_eos(tokenizer, text: str, max_len: int) -> tuple[list[int], bool]:
    """OpenRLHF's sample text: newlines stripped, `" " + EOS` added unless present, cut to `max_len`
    tokens with the last one forced to EOS. Returns (ids, whether the cut dropped tokens)."""
    eos, eos_id = _eos(tokenizer)
    text = text.rstrip("\n")
    ids = _encode(tokenizer, text if text.endswith(eos) else text + " " + eos)
    truncated = len(ids) > max_len
    ids = ids[:max_len]
    ids[-1] = eos_id
    return ids, truncated


def _formatting(tokenizer, max_len: int, least: int, input_template: str | None, apply_chat_template: bool,
                tokenizer_chat_template: str | None) -> ChatTemplate | None:
    """The checks every response loader starts with (`max_len` of at least `least`, an EOS, a valid template)
    and the chat template to format with (None: plain text with `input_template`)."""
    _check_max_len(max_len, least)
    _eos(tokenizer)
    chat = make_chat_template(tokenizer, apply_chat_template, tokenizer_chat_template)
    if chat is None:
        check_input_template(input_template)
    return chat


def token_id(tokenizer, token: str, flag: str) -> int:
    """The id of `token`, which must be exactly one known token of the tokenizer."""
    ids = _encode(tokenizer, token)
    if len(ids) != 1 or (ids[0] == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"{flag} {token!r} is not a single token of the tokenizer (it encodes to {ids}); "
                         "pick a token of the vocabulary")
    return ids[0]


# --- SFT ------------------------------------------------------------------------------------------


def _sft_texts(row: Row, *, input_key: str, output_key: str | None, input_template: str | None,
               chat: ChatTemplate | None, multiturn: bool) -> tuple[str, str, list[tuple[str, str]] | None, bool]:
    """(prompt, response, assistant turns with --multiturn else None, whether the row ends with an answer)."""
    value = column(row, input_key, "--input_key")
    if chat is not None and (multiturn or output_key is None):
        if not isinstance(value, list):
            raise ValueError(f"{row.where}: column {input_key!r} holds {type(value).__name__}; with "
                             "--apply_chat_template and no --output_key (or with --multiturn) it must be the "
                             "conversation as a message list; pass the response column with --output_key")
        messages = as_messages(value, "user", row.where, input_key)
        if output_key is not None:
            messages += as_messages(column(row, output_key, "--output_key"), "assistant", row.where, output_key)
        if not messages:
            return "", "", None, False  # skipped as an empty prompt
        prompt, response = split_last_turn(messages, chat, row.where)
        turns = assistant_turns(messages, chat, row.where) if multiturn else None
        return prompt, response, turns, messages[-1].get("role") == "assistant"
    prompt = prompt_text(value, input_template=input_template, chat=chat, where=row.where, key=input_key,
                         flag="--input_key")
    response = response_text(value, prompt, column(row, output_key, "--output_key"), chat=chat, where=row.where,
                             key=output_key, flag="--output_key")
    return prompt, response, None, True


def _turn_spans(tokenizer, turns: list[tuple[str, str]], max_len: int) -> list[tuple[int, int]]:
    """Half-open token spans of the assistant turns, each placed by the token count of the text before
    it (OpenRLHF: start = len(prompt ids), stop = start + len(response ids))."""
    spans = []
    for before, text in turns:
        start = len(_encode(tokenizer, before)[:max_len])
        spans.append((start, start + len(_encode(tokenizer, text)[:max_len])))
    return spans


def _sft_sample(row: Row, tokenizer, report: LoadReport, *, max_len: int, **text_args) -> SFTSample | None:
    prompt, response, turns, ends_with_answer = _sft_texts(row, **text_args)
    prompt_len = len(_encode(tokenizer, prompt)[:max_len])
    problem = ("empty prompt" if not prompt else "empty response" if not response
               else f"prompt of max_len - 2 = {max_len - 2} tokens or more" if prompt_len >= max_len - 2 else None)
    if problem:
        report.skip(problem, row.where)
        return None
    ids, truncated = _encode_with_eos(tokenizer, prompt + response, max_len)
    seq_len = len(ids)
    if turns is None:
        spans = [(prompt_len, seq_len)]
    else:
        spans = _turn_spans(tokenizer, turns, max_len)
        if spans and ends_with_answer:  # the EOS after the final answer is part of it
            spans[-1] = (spans[-1][0], max(spans[-1][1], seq_len))
    spans = [(max(start, 1), stop) for start, stop in spans if max(start, 1) < min(stop, seq_len)]
    mask = assistant_loss_mask_T1(spans, seq_len)
    if not mask.any():
        report.skip("no target token within max_len", row.where)
        return None
    report.num_truncated += truncated
    return SFTSample(torch.tensor(ids, dtype=torch.int64), mask, row.where)


def _pretrain_sample(row: Row, tokenizer, report: LoadReport, *, input_key: str, max_len: int) -> SFTSample | None:
    text = as_text(column(row, input_key, "--input_key"), row.where, input_key, "--input_key")
    ids = _encode(tokenizer, text)
    report.num_truncated += len(ids) > max_len
    ids = ids[:max_len]
    if len(ids) < 2:
        report.skip("fewer than 2 tokens", row.where)
        return None
    return SFTSample(torch.tensor(ids, dtype=torch.int64), torch.ones(len(ids) - 1, dtype=torch.bool), row.where)


def load_sft_samples(rows: list[Row], tokenizer, *, input_key: str, output_key: str | None,
                     input_template: str | None, apply_chat_template: bool, multiturn: bool, pretrain_mode: bool,
                     max_len: int, tokenizer_chat_template: str | None = None) -> tuple[list[SFTSample], LoadReport]:
    """SFT samples of `rows` (see the module docstring for what OpenRLHF behaviour they follow) and a
    report of what was cut or skipped (also warned). A missing column, a column of the wrong type or a
    bad flag combination is a ValueError naming the row or flag; no usable sample at all is one too."""
    report = LoadReport("SFT samples", num_rows=len(rows))
    if pretrain_mode:
        _check_max_len(max_len, 2)
        if multiturn:
            warnings.warn("--multiturn is ignored with --pretrain_mode (every token is a target)", stacklevel=2)
        samples = [_pretrain_sample(row, tokenizer, report, input_key=input_key, max_len=max_len) for row in rows]
        return _finish([s for s in samples if s is not None], report, "--input_key")
    _check_max_len(max_len, 3)
    _eos(tokenizer)
    chat = make_chat_template(tokenizer, apply_chat_template, tokenizer_chat_template)
    if chat is None:
        check_input_template(input_template)
        if multiturn:
            raise ValueError("--multiturn needs --apply_chat_template (turns are found with the chat template)")
        if output_key is None:
            raise ValueError("SFT without --apply_chat_template needs --output_key (the response column); "
                             "or train on the input text alone with --pretrain_mode")
    samples = [_sft_sample(row, tokenizer, report, max_len=max_len, input_key=input_key, output_key=output_key,
                           input_template=input_template, chat=chat, multiturn=multiturn) for row in rows]
    return _finish([s for s in samples if s is not None], report, "--input_key/--output_key")


# --- pairs (reward model) -------------------------------------------------------------------------


def _pair_texts(row: Row, *, prompt_key: str | None, chosen_key: str, rejected_key: str,
                input_template: str | None, chat: ChatTemplate | None) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts, as OpenRLHF's reward `preprocess_data`."""
    chosen_value = column(row, chosen_key, "--chosen_key")
    rejected_value = column(row, rejected_key, "--rejected_key")
    if prompt_key is None:  # whole conversations in the chosen/rejected columns
        return ("", conversation_text(chosen_value, chat=chat, where=row.where, key=chosen_key, flag="--chosen_key"),
                conversation_text(rejected_value, chat=chat, where=row.where, key=rejected_key, flag="--rejected_key"))
    prompt_value = column(row, prompt_key, "--prompt_key")
    prompt = prompt_text(prompt_value, input_template=input_template, chat=chat, where=row.where, key=prompt_key,
                         flag="--prompt_key")
    chosen = response_text(prompt_value, prompt, chosen_value, chat=chat, where=row.where, key=chosen_key,
                           flag="--chosen_key")
    rejected = response_text(prompt_value, prompt, rejected_value, chat=chat, where=row.where, key=rejected_key,
                             flag="--rejected_key")
    return prompt, chosen, rejected


def _margin(row: Row, margin_key: str | None) -> float | None:
    if margin_key is None:
        return None
    value = column(row, margin_key, "--margin_key (the margin column of --margin_loss)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{row.where}: margin column {margin_key!r} holds {value!r}, not a number")
    return float(value)


def _pair_sample(row: Row, tokenizer, report: LoadReport, *, max_len: int, margin_key: str | None,
                 skip_long_prompts: bool, **text_args) -> PairSample | None:
    prompt, chosen, rejected = _pair_texts(row, **text_args)
    margin = _margin(row, margin_key)
    prompt_len = len(_encode(tokenizer, prompt)[:max_len]) if prompt else 0
    if skip_long_prompts and prompt_len >= max_len - 2:
        report.skip(f"prompt of max_len - 2 = {max_len - 2} tokens or more", row.where)
        return None
    if chosen == rejected:
        report.skip("identical chosen and rejected", row.where)
        return None
    if not chosen.strip() or not rejected.strip():
        report.skip("empty chosen or rejected", row.where)
        return None
    chosen_ids, chosen_cut = _encode_with_eos(tokenizer, prompt + chosen, max_len)
    rejected_ids, rejected_cut = _encode_with_eos(tokenizer, prompt + rejected, max_len)
    if chosen_ids == rejected_ids:
        report.skip("identical after the cut to max_len", row.where)
        return None
    report.num_truncated += chosen_cut or rejected_cut
    return PairSample(torch.tensor(chosen_ids, dtype=torch.int64), torch.tensor(rejected_ids, dtype=torch.int64),
                      margin, row.where, prompt_len)


def load_pair_samples(rows: list[Row], tokenizer, *, prompt_key: str | None, chosen_key: str, rejected_key: str,
                      margin_key: str | None = None, input_template: str | None, apply_chat_template: bool,
                      max_len: int, tokenizer_chat_template: str | None = None,
                      skip_long_prompts: bool = False) -> tuple[list[PairSample], LoadReport]:
    """Preference pairs of `rows`: prompt + chosen and prompt + rejected token ids, each ending in EOS
    and at most `max_len` long, the prompt's token count, and the margin column's value when `margin_key`
    is given (OpenRLHF's `--margin_loss` reads the column "margin"). Without `prompt_key` the chosen/rejected
    columns hold whole conversations. Degenerate pairs are skipped and counted in the report (and warned);
    with `skip_long_prompts` (DPO, as OpenRLHF) so are pairs whose prompt has max_len - 2 tokens or more."""
    chat = _formatting(tokenizer, max_len, 2, input_template, apply_chat_template, tokenizer_chat_template)
    report = LoadReport("pairs", num_rows=len(rows))
    samples = [_pair_sample(row, tokenizer, report, max_len=max_len, margin_key=margin_key, prompt_key=prompt_key,
                            chosen_key=chosen_key, rejected_key=rejected_key, input_template=input_template,
                            chat=chat, skip_long_prompts=skip_long_prompts) for row in rows]
    return _finish([s for s in samples if s is not None], report, "--chosen_key/--rejected_key")


# --- unpaired (KTO) -------------------------------------------------------------------------------


def _label(row: Row, label_key: str) -> bool:
    value = column(row, label_key, "--label_key")
    if isinstance(value, bool) or (isinstance(value, (int, float)) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{row.where}: label column {label_key!r} holds {value!r}; KTO labels are true/false "
                     "(or 1/0): true for a desirable response")


def load_unpaired_samples(rows: list[Row], tokenizer, *, input_key: str, output_key: str | None, label_key: str,
                          chosen_key: str, rejected_key: str, input_template: str | None,
                          apply_chat_template: bool, max_len: int,
                          tokenizer_chat_template: str | None = None) -> tuple[list[UnpairedSample], LoadReport]:
    """KTO samples of `rows` (OpenRLHF `UnpairedPreferenceDataset`): a row with `label_key` is one response
    (prompt in `input_key`, response in `output_key`, formatted and cut as SFT samples); a row with
    `chosen_key` and `rejected_key` instead is a preference pair, turned into a desirable and an undesirable
    sample that remember their pair. Skips are counted as for SFT."""
    chat = _formatting(tokenizer, max_len, 3, input_template, apply_chat_template, tokenizer_chat_template)
    report = LoadReport("KTO samples", num_rows=len(rows))
    text_args = dict(input_key=input_key, input_template=input_template, chat=chat, multiturn=False)
    samples = []
    for row in rows:
        if label_key not in row.data and chosen_key in row.data and rejected_key in row.data:
            both = [(_sft_sample(row, tokenizer, report, max_len=max_len, output_key=key, **text_args), desirable)
                    for key, desirable in ((chosen_key, True), (rejected_key, False))]
            kept = [(one, desirable) for one, desirable in both if one is not None]
            pair = len(samples) if len(kept) == 2 else None  # a pair whose partner was skipped is no pair
            samples += [UnpairedSample(one, desirable, pair) for one, desirable in kept]
            continue
        desirable = _label(row, label_key)
        if chat is None and output_key is None:
            raise ValueError(f"{row.where}: a labelled row needs --output_key (the response column) without "
                             "--apply_chat_template")
        one = _sft_sample(row, tokenizer, report, max_len=max_len, output_key=output_key, **text_args)
        if one is not None:
            samples.append(UnpairedSample(one, desirable))
    return _finish(samples, report, "--input_key/--output_key/--label_key")


def mismatched(prompt_of: UnpairedSample, response_of: UnpairedSample, eos_id: int, max_len: int) -> SFTSample:
    """The prompt of one sample followed by the response (and EOS) of another, cut to `max_len` with the last
    token EOS: the KTO paper's mismatched pair for the KL reference point (token-level concatenation)."""
    prompt_len = prompt_of.prompt_len
    ids = torch.cat([prompt_of.sft.input_ids[:prompt_len], response_of.sft.input_ids[response_of.prompt_len:]])
    ids = ids[:max_len].clone()
    ids[-1] = eos_id
    return SFTSample(ids, assistant_loss_mask_T1([(prompt_len, len(ids))], len(ids)), prompt_of.sft.where)


# --- process reward model -------------------------------------------------------------------------


def _prm_labels(labels: Any, row: Row, label_key: str, tokenizer, reward_tokens: list[str] | None) -> torch.Tensor:
    """Hard labels (strings) -> int64 index in `reward_tokens` (token ids when `reward_tokens` is None, as
    OpenRLHF classifies over the whole vocabulary then); soft labels (numbers) -> float32."""
    if not isinstance(labels, list):
        raise ValueError(f"{row.where}: label column {label_key!r} holds {type(labels).__name__}; it must be a "
                         "list with one label per step")
    if all(isinstance(x, str) for x in labels):
        if reward_tokens is None:
            return torch.tensor([token_id(tokenizer, x, f"{row.where}: label") for x in labels], dtype=torch.int64)
        unknown = [x for x in labels if x not in reward_tokens]
        if unknown:
            raise ValueError(f"{row.where}: label {unknown[0]!r} is not one of --reward_tokens "
                             f"{' '.join(reward_tokens)}; fix the row or the flag")
        return torch.tensor([reward_tokens.index(x) for x in labels], dtype=torch.int64)
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in labels):
        if reward_tokens is None or len(reward_tokens) != 2:
            raise ValueError(f"{row.where}: numeric (soft) labels need exactly two --reward_tokens (positive "
                             "first, as OpenRLHF's PRM loss)")
        if any(not 0.0 <= x <= 1.0 for x in labels):
            raise ValueError(f"{row.where}: soft labels are probabilities in [0, 1]; got {labels}")
        return torch.tensor(labels, dtype=torch.float32)
    raise ValueError(f"{row.where}: label column {label_key!r} mixes strings and numbers; use reward-token "
                     "strings (hard labels) or probabilities (soft labels)")


def _prm_sample(row: Row, tokenizer, report: LoadReport, *, input_key: str, label_key: str, placeholder_token: str,
                placeholder_id: int, reward_tokens: list[str] | None, max_len: int) -> PRMSample | None:
    text = as_text(column(row, input_key, "--input_key"), row.where, input_key, "--input_key")
    labels = _prm_labels(column(row, label_key, "--label_key"), row, label_key, tokenizer, reward_tokens)
    ids = torch.tensor(_encode(tokenizer, text), dtype=torch.int64)
    positions = (ids == placeholder_id).nonzero().flatten()
    if len(positions) != len(labels):
        raise ValueError(f"{row.where}: {len(labels)} labels in column {label_key!r} but {len(positions)} "
                         f"placeholders {placeholder_token!r} in column {input_key!r} (after tokenisation); give "
                         "one label per step, and put the --placeholder_token after each step")
    report.num_truncated += len(ids) > max_len
    ids = ids[:max_len]
    kept = positions < max_len
    if not kept.any():
        report.skip("no placeholder within max_len", row.where)
        return None
    return PRMSample(ids, positions[kept], labels[kept], row.where)


def load_prm_samples(rows: list[Row], tokenizer, *, input_key: str, label_key: str, placeholder_token: str,
                     reward_tokens: list[str] | None, max_len: int) -> tuple[list[PRMSample], LoadReport]:
    """Process-reward samples of `rows`: the input's token ids cut to `max_len`, the positions of the
    `placeholder_token` (one after each step) and one label per placeholder. The placeholder and reward
    tokens must each be one token of the tokenizer, the label count must equal the placeholder count,
    and every row must use the same kind of label (hard or soft); otherwise a ValueError naming the row
    or flag. Rows with no placeholder left within `max_len` are skipped and counted."""
    _check_max_len(max_len, 1)
    if placeholder_token is None:
        raise ValueError("--placeholder_token is required for process reward data")
    placeholder_id = token_id(tokenizer, placeholder_token, "--placeholder_token")
    for token in reward_tokens or ():
        token_id(tokenizer, token, "--reward_tokens")
    report = LoadReport("PRM samples", num_rows=len(rows))
    samples: list[PRMSample] = []
    for row in rows:
        sample = _prm_sample(row, tokenizer, report, input_key=input_key, label_key=label_key,
                             placeholder_token=placeholder_token, placeholder_id=placeholder_id,
                             reward_tokens=reward_tokens, max_len=max_len)
        if sample is None:
            continue
        if samples and sample.labels.dtype != samples[0].labels.dtype:
            raise ValueError(f"{row.where}: {'soft' if sample.labels.is_floating_point() else 'hard'} labels, but "
                             f"{samples[0].where} has the other kind; use one kind in the whole dataset")
        samples.append(sample)
    return _finish(samples, report, "--input_key/--label_key")


# --- batches --------------------------------------------------------------------------------------

def _pad(seqs: list[torch.Tensor], width: int, value: float | int) -> torch.Tensor:
    """Right-pad 1-D tensors to `width` and stack them: [len(seqs), width]."""
    out = torch.full((len(seqs), width), value, dtype=seqs[0].dtype)
    for i, seq in enumerate(seqs):
        out[i, :len(seq)] = seq
    return out


@dataclass
class SFTBatch(TokenBatch):
    """SFT micro-batch.

    input_ids_BT: int64 [B, T] right-padded with the pad id.
    attention_mask_BT: int64 [B, T] 1 on real tokens.
    loss_mask_BT1: float32 [B, T-1] 1 where token t + 1 is a target (0 on prompt and padding).
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT1: torch.Tensor

    @classmethod
    def collate(cls, samples: list[SFTSample], pad_id: int) -> SFTBatch:
        width = max(len(s.input_ids) for s in samples)
        return cls(_pad([s.input_ids for s in samples], width, pad_id),
                   _pad([torch.ones(len(s.input_ids), dtype=torch.int64) for s in samples], width, 0),
                   _pad([s.loss_mask.float() for s in samples], width - 1, 0.0))


@dataclass
class PairBatch(TokenBatch):
    """Reward-model micro-batch of B pairs; chosen and rejected are padded to the same T, so
    `concatenated()` gives one [2B, T] batch for a single forward (rows 0..B-1 chosen, B..2B-1 rejected).

    chosen_ids_BT / rejected_ids_BT: int64 [B, T] prompt + response + EOS, right-padded with the pad id.
    chosen_mask_BT / rejected_mask_BT: int64 [B, T] 1 on real tokens; the reward is read at the last one
        (`mask.sum(-1) - 1`), the EOS.
    margins_B: float32 [B], or None when the data has no margin column.
    prompt_lens_B: int64 [B], the prompt's tokens at the start of both sequences.
    """

    chosen_ids_BT: torch.Tensor
    chosen_mask_BT: torch.Tensor
    rejected_ids_BT: torch.Tensor
    rejected_mask_BT: torch.Tensor
    margins_B: torch.Tensor | None = None
    prompt_lens_B: torch.Tensor | None = None

    _masks: ClassVar[tuple[str, ...]] = ("chosen_mask_BT", "rejected_mask_BT")

    @classmethod
    def collate(cls, samples: list[PairSample], pad_id: int) -> PairBatch:
        width = max(max(len(s.chosen_ids), len(s.rejected_ids)) for s in samples)
        ones = lambda t: torch.ones(len(t), dtype=torch.int64)  # noqa: E731
        has_margin = {s.margin is not None for s in samples}
        assert len(has_margin) == 1, "a batch mixes pairs with and without margins"
        margins = torch.tensor([s.margin for s in samples], dtype=torch.float32) if has_margin == {True} else None
        return cls(_pad([s.chosen_ids for s in samples], width, pad_id),
                   _pad([ones(s.chosen_ids) for s in samples], width, 0),
                   _pad([s.rejected_ids for s in samples], width, pad_id),
                   _pad([ones(s.rejected_ids) for s in samples], width, 0), margins,
                   torch.tensor([s.prompt_len for s in samples], dtype=torch.int64))

    def concatenated(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids_2BT, attention_mask_2BT): chosen rows then rejected rows."""
        return (torch.cat([self.chosen_ids_BT, self.rejected_ids_BT]),
                torch.cat([self.chosen_mask_BT, self.rejected_mask_BT]))


@dataclass
class UnpairedBatch(TokenBatch):
    """KTO micro-batch: an `SFTBatch`'s fields and each sample's label and pair.

    desirable_B: bool [B]. pair_B: int64 [B], the preference pair a sample came from, -1 for none.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT1: torch.Tensor
    desirable_B: torch.Tensor
    pair_B: torch.Tensor

    @classmethod
    def collate(cls, samples: list[UnpairedSample], pad_id: int) -> UnpairedBatch:
        sft = SFTBatch.collate([s.sft for s in samples], pad_id)
        return cls(sft.input_ids_BT, sft.attention_mask_BT, sft.loss_mask_BT1,
                   torch.tensor([s.desirable for s in samples], dtype=torch.bool),
                   torch.tensor([-1 if s.pair is None else s.pair for s in samples], dtype=torch.int64))


@dataclass
class PRMBatch(TokenBatch):
    """Process-reward micro-batch; the model's logits at a placeholder position are scored.

    input_ids_BT: int64 [B, T] right-padded with the pad id.
    attention_mask_BT: int64 [B, T] 1 on real tokens.
    label_mask_BT: bool [B, T] true at the placeholder positions that carry a label.
    labels_BT: [B, T] int64 class index (hard labels) or float32 probability of the first reward token
        (soft labels) at those positions; IGNORE_INDEX (-100) everywhere else.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    label_mask_BT: torch.Tensor
    labels_BT: torch.Tensor

    @classmethod
    def collate(cls, samples: list[PRMSample], pad_id: int) -> PRMBatch:
        width = max(len(s.input_ids) for s in samples)
        dtypes = {s.labels.dtype for s in samples}
        assert len(dtypes) == 1, f"a batch mixes hard and soft labels: {dtypes}"
        label_mask = torch.zeros(len(samples), width, dtype=torch.bool)
        labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=dtypes.pop())
        for i, s in enumerate(samples):
            label_mask[i, s.positions] = True
            labels[i, s.positions] = s.labels
        return cls(_pad([s.input_ids for s in samples], width, pad_id),
                   _pad([torch.ones(len(s.input_ids), dtype=torch.int64) for s in samples], width, 0),
                   label_mask, labels)
