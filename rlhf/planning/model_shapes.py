"""The shape of a decoder-only transformer as the memory plan needs it, read from a model directory's
config.json (or a shipped shape file) without loading any weight. Knows Llama-style blocks (Llama, Qwen2,
Mistral and their kin: RMSNorm, grouped-query attention, a gated MLP); it does not know mixtures of experts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rlhf.config.errors import UsageError

SHAPES_DIR = Path(__file__).resolve().parent.parent / "assets" / "shapes"
"""Shipped config.json files of public model shapes (no weights), named by model: `shape_path("qwen2.5-7b")`."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-style causal LM. `kv_heads` < `heads` is grouped-query attention; `qkv_bias`: Qwen2's
    biases on the q/k/v projections; `tied`: the output layer shares the input embedding."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder block: q and o (hidden x heads·head_dim each), k and v (hidden x kv_dim each), the gated
        MLP (3 x hidden x intermediate), two RMSNorm weights, and the q/k/v biases where present."""
        d, q = self.hidden, self.heads * self.head_dim
        attention = 2 * d * q + 2 * d * self.kv_dim + (q + 2 * self.kv_dim if self.qkv_bias else 0)
        return attention + 3 * d * self.intermediate + 2 * d

    def params(self, scalar_head: bool = False) -> int:
        """All parameters: embedding, blocks, final norm and the output layer (vocab x hidden unless tied; a
        critic or reward model replaces it with a hidden x 1 scalar head)."""
        embedding = self.vocab * self.hidden
        output = self.hidden if scalar_head else (0 if self.tied else self.vocab * self.hidden)
        return embedding + self.layers * self.layer_params + self.hidden + output

    def linear_dims(self) -> list[tuple[int, int]]:
        """(in, out) of every linear layer in one block (what LoRA's all-linear adapts)."""
        d, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return [(d, q), (d, kv), (d, kv), (q, d), (d, i), (d, i), (i, d)]


def shape_from_config(config: dict, where: str) -> ModelShape:
    """The shape in an HF config dict (a multimodal config's `text_config` is its language model); `where`
    names the file in errors."""
    config = config.get("text_config", config)
    if config.get("num_local_experts") or config.get("num_experts"):
        raise UsageError(f"{where}: mixture-of-experts models are not in the memory plan's model of a block")
    try:
        d, heads = config["hidden_size"], config["num_attention_heads"]
        return ModelShape(hidden=d, layers=config["num_hidden_layers"], heads=heads,
                          kv_heads=config.get("num_key_value_heads") or heads,
                          head_dim=config.get("head_dim") or d // heads, intermediate=config["intermediate_size"],
                          vocab=config["vocab_size"], tied=bool(config.get("tie_word_embeddings", False)),
                          qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")))
    except KeyError as err:
        raise UsageError(f"{where} lacks {err.args[0]}: the memory plan needs a decoder-only transformer's "
                         "config (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, "
                         "vocab_size)") from err


def read_shape(model_dir: str) -> ModelShape:
    """The shape of the model at `model_dir` (its config.json only)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"{model_dir}: no config.json to plan the memory of")
    with open(path) as f:
        return shape_from_config(json.load(f), path)


def shape_path(name: str) -> str:
    """The directory holding the shipped config.json of `name` (e.g. "qwen2.5-7b", "llama-3-70b")."""
    path = SHAPES_DIR / name
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in SHAPES_DIR.iterdir() if p.is_dir())
        raise UsageError(f"no shipped shape {name!r}; known: {', '.join(known)}")
    return str(path)
