"""Build the embedded tiny demo under `rlhf/assets/tiny/`: a word-level tokenizer, a small random
Llama policy, a prompt set, a rule-based reward and the supervised data. Deterministic for a given seed.

The task: each prompt ends with "copy D :" for a digit D (after a few filler words); the reward is the
fraction of the first four response words equal to D. A random policy scores about 0.02-0.1; a
policy that learned to copy scores 1.

Supervised data of the same task (JSON Lines; train file and a smaller `_eval` file each):
- `sft.jsonl`: {"input": "q copy 5 :", "output": "5 5 5 5"}, the demonstration (`--input_key input
  --output_key output`; with `--apply_chat_template` the two strings become a user and an assistant turn).
- `pairs.jsonl`: {"prompt": ..., "chosen": ..., "rejected": ..., "margin": ...}; four answer words each,
  the chosen one with strictly more copies of D than the rejected one, so the rule reward above ranks
  every pair right; margin = (chosen copies - rejected copies) / 4 (`--prompt_key prompt`).
- `prm.jsonl`: {"input": "q copy 5 : 5 w0 x w0 5 w0 5 w0", "label": ["w1", "w2", "w1", "w1"]}: four
  one-word steps, each followed by the placeholder, labelled good when the step is the digit D. The
  placeholder and reward tokens are vocabulary words no other file uses: `--placeholder_token w0
  --reward_tokens w1 w2` (w1 = good, listed first as OpenRLHF's soft labels expect; w2 = bad).
Prompt and answer are joined without a separator (as OpenRLHF does) and the vocabulary splits on
whitespace, so plain-text runs pass `--input_template "{} "`; `--apply_chat_template` needs nothing.

    python -m rlhf.cli.build_tiny [--out DIR] [--seed 0] [--data_only]

Every file it writes is identical to the shipped one except `reward_model/model.safetensors`: the shipped
reward model was trained by an earlier revision of this script, which drew its training samples differently.
A rebuild fits as well (mean squared error about 0.003 on the copy-task reward) with other weights, which
would move every reward-model figure in the README; rebuild with --data_only unless that is meant.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

from rlhf.assets import EMBEDDED_PRM_PLACEHOLDER, EMBEDDED_PRM_REWARD_TOKENS, TINY_DIR

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
DIGITS = [str(d) for d in range(10)]
FILLER = list("abcdefghijklmnopqrstuvwxyz")
WORDS = ["copy", ":", "user", "assistant", "system"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
REWARD_SOURCE = '''"""Reward of the embedded demo: the fraction of the first four response words equal to the label."""

import torch


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        words = query[len(prompt):].split()[:4]
        rewards.append(sum(w == str(label) for w in words) / 4.0)
    return torch.tensor(rewards, dtype=torch.float32)
'''


def vocabulary() -> list[str]:
    """The 64 words of the tokenizer, in id order; `w0`.. fill the unused ids."""
    vocab_list = SPECIALS + WORDS + DIGITS + FILLER
    return vocab_list + [f"w{i}" for i in range(64 - len(vocab_list))]


def build_tokenizer(out_dir: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    return tok


def build_policy(out_dir: str, tok, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)


def build_prompts(path: str, seed: int, num_prompts: int = 512) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_prompts):
            digit = rng.choice(DIGITS)
            filler = " ".join(rng.choice(FILLER) for _ in range(rng.randint(0, 3)))
            text = f"{filler} copy {digit} :".strip()
            f.write(json.dumps({"input": text, "label": digit}) + "\n")


def _copy_task_samples(tok, rng: random.Random, count: int) -> tuple[list[str], list[str], list[float]]:
    """Prompt/response pairs whose number of label copies is uniform over 0..4, and their rule reward."""
    words = DIGITS + FILLER + ["</s>"]
    prompts, responses, rewards = [], [], []
    for _ in range(count):
        digit = rng.choice(DIGITS)
        filler = " ".join(rng.choice(FILLER) for _ in range(rng.randint(0, 3)))
        copies = rng.randint(0, 4)
        others = [w for w in words if w != digit]
        head = [digit] * copies + [rng.choice(others) for _ in range(4 - copies)]
        rng.shuffle(head)
        tail = [rng.choice(words) for _ in range(rng.randint(0, 4))]
        prompts.append(f"{filler} copy {digit} :".strip())
        responses.append(" ".join(head + tail))
        rewards.append(copies / 4.0)
    return prompts, responses, rewards


def build_reward_model(out_dir: str, policy_dir: str, tok, seed: int, steps: int = 600) -> None:
    """A scalar-head model trained by regression to predict the copy-task reward of a response."""
    from rlhf.models.value import load_scalar_head_model, save_scalar_head_model

    model = load_scalar_head_model(policy_dir, "score", torch.float32, "sdpa", fresh_head=True)
    torch.manual_seed(seed + 1)  # after the load: every weight is drawn again below
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05) if p.dim() > 1 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed + 1)
    for step in range(steps):
        prompts, responses, rewards = _copy_task_samples(tok, rng, 64)
        enc = tok([p + " " + r for p, r in zip(prompts, responses)], padding=True, return_tensors="pt",
                  add_special_tokens=False)
        values = model(enc["input_ids"], enc["attention_mask"])
        last = enc["attention_mask"].sum(-1) - 1
        pred = values.gather(1, last[:, None]).squeeze(1)
        loss = torch.nn.functional.mse_loss(pred, torch.tensor(rewards))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"reward model step {step}: mse {loss.item():.4f}")
    save_scalar_head_model({k: v.detach() for k, v in model.state_dict().items()}, model.config, "score", out_dir,
                           tok)


def _copy_prompt(rng: random.Random) -> tuple[str, str]:
    """A copy-task prompt and its digit."""
    digit = rng.choice(DIGITS)
    filler = " ".join(rng.choice(FILLER) for _ in range(rng.randint(0, 3)))
    return f"{filler} copy {digit} :".strip(), digit


def _answer_words(rng: random.Random, digit: str, copies: int) -> list[str]:
    """Four answer words, `copies` of them the digit (in random places), the others other digits/letters."""
    others = [w for w in DIGITS + FILLER if w != digit]
    words = [digit] * copies + [rng.choice(others) for _ in range(4 - copies)]
    rng.shuffle(words)
    return words


def _sft_row(rng: random.Random) -> dict:
    prompt, digit = _copy_prompt(rng)
    return {"input": prompt, "output": " ".join([digit] * 4)}


def _pair_row(rng: random.Random) -> dict:
    prompt, digit = _copy_prompt(rng)
    rejected_copies, chosen_copies = sorted(rng.sample(range(5), 2))
    return {"prompt": prompt, "chosen": " ".join(_answer_words(rng, digit, chosen_copies)),
            "rejected": " ".join(_answer_words(rng, digit, rejected_copies)),
            "margin": (chosen_copies - rejected_copies) / 4}


def _prm_row(rng: random.Random) -> dict:
    prompt, digit = _copy_prompt(rng)
    words = _answer_words(rng, digit, rng.randint(0, 4))
    good, bad = EMBEDDED_PRM_REWARD_TOKENS
    return {"input": prompt + "".join(f" {w} {EMBEDDED_PRM_PLACEHOLDER}" for w in words),
            "label": [good if w == digit else bad for w in words]}


DATA_FILES = {"sft": _sft_row, "pairs": _pair_row, "prm": _prm_row}


def build_data(out_dir: str, seed: int, num_train: int = 1024, num_eval: int = 128) -> None:
    """The supervised data files (`{name}.jsonl` and `{name}_eval.jsonl`), each from its own seeded stream."""
    vocab = set(vocabulary())
    special = set(SPECIALS + WORDS + DIGITS + FILLER)
    for token in (EMBEDDED_PRM_PLACEHOLDER, *EMBEDDED_PRM_REWARD_TOKENS):
        assert token in vocab and token not in special, f"PRM token {token!r} must be an unused vocabulary word"
    for name, make_row in DATA_FILES.items():
        for suffix, count in (("", num_train), ("_eval", num_eval)):
            rng = random.Random(f"{name}{suffix}:{seed}")
            with open(os.path.join(out_dir, f"{name}{suffix}.jsonl"), "w", encoding="utf-8") as f:
                for _ in range(count):
                    f.write(json.dumps(make_row(rng)) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(TINY_DIR))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_only", action="store_true",
                        help="write only the supervised data files (sft, pairs, prm), leave the rest as is")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    build_data(args.out, args.seed)
    if args.data_only:
        print(f"wrote the supervised data to {args.out}")
        return
    policy_dir = os.path.join(args.out, "policy")
    os.makedirs(policy_dir, exist_ok=True)
    tok = build_tokenizer(policy_dir)
    build_policy(policy_dir, tok, args.seed)
    build_prompts(os.path.join(args.out, "prompts.jsonl"), args.seed)
    build_reward_model(os.path.join(args.out, "reward_model"), policy_dir, tok, args.seed)
    with open(os.path.join(args.out, "reward.py"), "w", encoding="utf-8") as f:
        f.write(REWARD_SOURCE)
    print(f"wrote the tiny demo to {args.out}")


if __name__ == "__main__":
    main()
