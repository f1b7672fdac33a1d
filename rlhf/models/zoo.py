"""A tiny model zoo built here, no downloads: a random-weight model of each common family from its own
`transformers` config class, with a byte-level BPE tokenizer trained here (the `tokenizers` library) that
reproduces the family's special-token behaviour and a chat template written here in the family's turn format.

What a family's tokenizer reproduces (`Family` fields): which of bos / eos / pad exist, whether encoding adds
BOS (and whether the chat template writes it again: text rendered by the template must be encoded with
`add_special_tokens=False`, or BOS comes twice), which token ends a chat turn, and the generation eos ids
(`generation_config.json`) that a rollout engine must stop on besides the tokenizer's eos.

Shapes: hidden 64, 2 layers, 2 query heads of head_dim 32 over 1 kv head (grouped-query attention), weights
drawn with std 0.1 (larger than the families' 0.02, so attention is far from uniform at this size and a
dropped sliding window or soft-cap changes the output measurably). Sliding windows are 8 tokens and Gemma-2's
attention soft-cap 1.0 (50.0 in the real models) for the same reason. Mixture-of-experts families have 4
experts, 2 per token.

    python -m rlhf.cli.build_zoo --family mixtral --out /tmp/zoo    (--family all: every family)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 2, 2, 1, 32, 128
WINDOW = 8
INIT_STD = 0.1
VOCAB_SIZE = 384  # 256 byte symbols, the special tokens and the merges learned from CORPUS


@dataclass(frozen=True)
class Family:
    """One family: its transformers config class and overrides, and its tokenizer's special-token behaviour."""

    name: str
    config_class: str
    config: dict
    specials: tuple[str, ...]  # every special token, added to the vocabulary in this order
    bos: str | None  # the tokenizer's bos_token (None: the family has none)
    add_bos: bool  # whether encoding adds BOS
    eos: str  # the tokenizer's eos_token
    pad: str | None  # the tokenizer's pad_token (None: the family ships without one)
    turn_end: str  # the token that ends a chat turn (what a chat rollout must stop on)
    generation_eos: tuple[str, ...]  # generation_config.eos_token_id
    chat_template: str
    system_role: bool = True  # whether the template accepts a system message
    moe: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


_LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('Mistral chat has user and assistant turns only') }}{% endif %}{% endfor %}")
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('Gemma chat has no system role') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>")
_WINDOW = {"sliding_window": WINDOW}
_MOE_QWEN = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama3", "LlamaConfig", {"rope_theta": 500000.0},
           ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
           bos="<|begin_of_text|>", add_bos=True, eos="<|end_of_text|>", pad=None, turn_end="<|eot_id|>",
           generation_eos=("<|end_of_text|>", "<|eot_id|>"), chat_template=_LLAMA3_TEMPLATE,
           notes=("no pad token", "the template writes BOS and encoding adds it",
                  "a chat turn ends with <|eot_id|>, not the tokenizer's eos")),
    Family("qwen2.5", "Qwen2Config", {"rope_theta": 1000000.0, "tie_word_embeddings": True}, _QWEN_SPECIALS,
           bos=None, add_bos=False, eos="<|im_end|>", pad="<|endoftext|>", turn_end="<|im_end|>",
           generation_eos=("<|im_end|>", "<|endoftext|>"), chat_template=_CHATML_TEMPLATE,
           notes=("no BOS", "q/k/v projections have biases", "pad <|endoftext|> differs from eos <|im_end|>")),
    Family("qwen3", "Qwen3Config", {"rope_theta": 1000000.0, "tie_word_embeddings": True}, _QWEN_SPECIALS,
           bos=None, add_bos=False, eos="<|im_end|>", pad="<|endoftext|>", turn_end="<|im_end|>",
           generation_eos=("<|im_end|>", "<|endoftext|>"), chat_template=_CHATML_TEMPLATE,
           notes=("no BOS", "q/k RMSNorm")),
    Family("mistral", "MistralConfig", dict(_WINDOW), _MISTRAL_SPECIALS,
           bos="<s>", add_bos=True, eos="</s>", pad=None, turn_end="</s>", generation_eos=("</s>",),
           chat_template=_MISTRAL_TEMPLATE, system_role=False,
           notes=("no pad token", f"sliding window of {WINDOW} tokens", "the template writes BOS")),
    Family("gemma2", "Gemma2Config",
           {**_WINDOW, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 5.0, "tie_word_embeddings": True,
            "query_pre_attn_scalar": HEAD_DIM, "hidden_activation": "gelu_pytorch_tanh"},
           ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
           bos="<bos>", add_bos=True, eos="<eos>", pad="<pad>", turn_end="<end_of_turn>",
           generation_eos=("<eos>", "<end_of_turn>"), chat_template=_GEMMA_TEMPLATE, system_role=False,
           notes=(f"sliding window of {WINDOW} tokens on alternate layers", "attention and final-logit soft-capping",
                  "a chat turn ends with <end_of_turn>, not the tokenizer's eos")),
    Family("gemma3", "Gemma3TextConfig",
           {**_WINDOW, "query_pre_attn_scalar": HEAD_DIM, "layer_types": ["sliding_attention", "full_attention"],
            "tie_word_embeddings": True,
            "rope_local_base_freq": 10000.0},
           ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
           bos="<bos>", add_bos=True, eos="<eos>", pad="<pad>", turn_end="<end_of_turn>",
           generation_eos=("<eos>", "<end_of_turn>"), chat_template=_GEMMA_TEMPLATE, system_role=False,
           notes=(f"sliding window of {WINDOW} tokens on the first layer", "q/k RMSNorm")),
    Family("phi3", "Phi3Config", {}, ("<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                                      "<|end|>"),
           bos="<s>", add_bos=False, eos="<|endoftext|>", pad="<|endoftext|>", turn_end="<|end|>",
           generation_eos=("<|endoftext|>", "<|end|>"), chat_template=_PHI3_TEMPLATE,
           notes=("fused qkv_proj and gate_up_proj", "a chat turn ends with <|end|>, not the tokenizer's eos")),
    Family("qwen3-moe", "Qwen3MoeConfig", {"rope_theta": 1000000.0, **_MOE_QWEN}, _QWEN_SPECIALS,
           bos=None, add_bos=False, eos="<|im_end|>", pad="<|endoftext|>", turn_end="<|im_end|>",
           generation_eos=("<|im_end|>", "<|endoftext|>"), chat_template=_CHATML_TEMPLATE, moe=True,
           notes=("4 experts, 2 per token",)),
    Family("mixtral", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, _MISTRAL_SPECIALS,
           bos="<s>", add_bos=True, eos="</s>", pad=None, turn_end="</s>", generation_eos=("</s>",),
           chat_template=_MISTRAL_TEMPLATE, system_role=False, moe=True,
           notes=("4 experts, 2 per token", "no pad token")),
)}

CORPUS = [  # the copy task's words and the chat roles, enough for a few hundred merges
    "copy", "user", "assistant", "system", "model", "the answer is", "please copy the digit",
    *[f"q copy {d} : {d} {d} {d} {d}" for d in range(10)],
    *[f"{a} {b} {c} copy" for a, b, c in zip("abcdefghijklm", "nopqrstuvwxyz", "mnopqrstuvwxy")],
    "Hello, how are you? I am fine, thank you.", "Sliding windows and soft caps; experts route tokens.",
]


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; the zoo builds {', '.join(FAMILIES)}")
    return FAMILIES[name]


def build_tokenizer(fam: Family, out_dir: str | None = None):
    """The family's byte-level BPE tokenizer (trained on CORPUS) as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(fam.specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS * 4, trainer=trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if fam.add_bos:
        bos_id = core.token_to_id(fam.bos)
        add_bos = processors.TemplateProcessing(single=f"{fam.bos} $A", pair=f"{fam.bos} $A {fam.bos} $B",
                                                special_tokens=[(fam.bos, bos_id)])
        core.post_processor = processors.Sequence([byte_level, add_bos])
    else:
        core.post_processor = byte_level
    special = {"eos_token": fam.eos}
    if fam.bos:
        special["bos_token"] = fam.bos
    if fam.pad:
        special["pad_token"] = fam.pad
    tok = PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False, **special)
    tok.chat_template = fam.chat_template
    if out_dir:
        tok.save_pretrained(out_dir)
    return tok


def model_config(fam: Family, tok, shape: dict | None = None):
    """The family's transformers config at the zoo's shape (`shape` overrides it: a realistic one for a GPU check),
    its special-token ids set from `tok`."""
    import transformers

    ids = {"eos_token_id": tok.convert_tokens_to_ids(fam.eos),
           "bos_token_id": tok.convert_tokens_to_ids(fam.bos) if fam.bos else None,
           "pad_token_id": tok.convert_tokens_to_ids(fam.pad) if fam.pad else None}
    tiny = {"vocab_size": len(tok), "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
             "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
             "head_dim": HEAD_DIM, "max_position_embeddings": 4096, "initializer_range": INIT_STD,
             "attention_dropout": 0.0, "tie_word_embeddings": False}
    config_class = getattr(transformers, fam.config_class)
    fields = {**tiny, **ids, **fam.config, **(shape or {})}
    types = fields.get("layer_types")
    if types and len(types) != fields["num_hidden_layers"] and "layer_types" not in (shape or {}):
        # the family's pattern of attention kinds, repeated over the layers `shape` asks for
        fields["layer_types"] = [types[i % len(types)] for i in range(fields["num_hidden_layers"])]
    return config_class(**{**fields, "dtype": "float32"})


def build_model(fam: Family, out_dir: str, seed: int = 0, tok=None, shape: dict | None = None):
    """Random weights of the family at the zoo's shape (or `shape`'s overrides), saved with its tokenizer and
    generation eos ids."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    tok = tok or build_tokenizer(fam, out_dir)
    config = model_config(fam, tok, shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    generation_eos = [tok.convert_tokens_to_ids(t) for t in fam.generation_eos]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
        eos_token_id=generation_eos if len(generation_eos) > 1 else generation_eos[0])
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "zoo_family.json"), "w", encoding="utf-8") as f:
        json.dump({"family": fam.name, "turn_end": fam.turn_end, "notes": list(fam.notes)}, f, indent=1)
    return model, tok


def build_family(name: str, out_dir: str, seed: int = 0, shape: dict | None = None) -> str:
    """Build family `name` into `out_dir` (model, tokenizer, chat template, generation config); returns out_dir.
    `shape`: config overrides (hidden size, layers, heads, window...) for a larger model of the family."""
    fam = family(name)
    tok = build_tokenizer(fam, out_dir)
    build_model(fam, out_dir, seed, tok, shape)
    return out_dir
