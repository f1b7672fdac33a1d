"""Loading HF tokenizers and causal LMs from local directories. Nothing here downloads.

Besides the loaders: the checks that refuse a model before its weights load (a damaged or remote path, a tokenizer
without vocabulary, attention the packed kernels cannot run) and what a model family needs at load time (eager
attention where SDPA would drop a soft-cap, the MoE router loss). Knows nothing about DeepSpeed: ZeRO-3 partitions
what these loaders build inside `rlhf.engines.deepspeed_engine.DeepSpeedModel`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import torch

from rlhf.config.errors import UsageError
from rlhf.models.model_files import check_model_files


def check_local_model(path: str, flag: str = "--pretrain") -> None:
    """`path` must be a local HF model directory: models are never downloaded at run time (every rank would
    race to fetch it, and cluster nodes often have no internet)."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        check_model_files(path, flag)  # config, weights and their headers: a damaged copy fails now
        return
    if not os.path.exists(path) and path.count("/") == 1 and not path.startswith((".", "/")):
        raise UsageError(f"{flag} {path}: the model must be a local path; {path!r} looks like a Hugging Face hub "
                         "name, and nothing is downloaded at run time: fetch it first (e.g. `huggingface-cli download "
                         f"{path} --local-dir DIR`) and pass {flag} DIR")
    raise UsageError(f"{flag} {path}: the model must be a local HF model directory (with config.json); nothing is "
                     "downloaded at run time")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json + merges.txt")
"""The vocabulary files of the common tokenizers (fast, sentencepiece, byte-level BPE), named in errors."""


def _looks_like_vocabulary(name: str) -> bool:
    """Whether a file in a model directory may hold a tokenizer's vocabulary (any tokenizer, remote code too)."""
    stem, ext = os.path.splitext(name)
    return name != "tokenizer_config.json" and ("tokenizer" in stem or "vocab" in stem or "merges" in stem
                                                or ext in (".model", ".tiktoken"))


def slow_tokenizer_kwargs(path: str, transformers_major: int) -> dict:
    """`AutoTokenizer.from_pretrained` arguments for --disable_fast_tokenizer. transformers 4 keeps a slow
    (Python) class per model: use_fast=False, as OpenRLHF. transformers 5 has dropped them and ignores use_fast;
    its closest equivalent is the sentencepiece backend, which a directory with a sentencepiece model
    (tokenizer.model) can use; elsewhere the fast tokenizer is the only one, with a warning."""
    if transformers_major < 5:
        return {"use_fast": False}
    if os.path.isfile(os.path.join(path, "tokenizer.model")):
        return {"backend": "sentencepiece"}
    warnings.warn(f"--disable_fast_tokenizer has no effect on {path}: transformers {transformers_major} has no "
                  "slow tokenizers, and this directory has no sentencepiece model (tokenizer.model) for its "
                  "sentencepiece backend; loading the fast tokenizer", stacklevel=3)
    return {}


TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json")
"""The tokenizer files that are JSON: each is parsed before transformers reads it, so a damaged one is named."""


def check_tokenizer_json(path: str, flag: str) -> None:
    """Every JSON tokenizer file in `path` parses; a damaged one (cut short by a full disk or a broken copy) is a
    UsageError naming the file, where it breaks and the fix (transformers says only `Expecting ',' delimiter`)."""
    for name in TOKENIZER_JSON_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            where = f"line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else "its bytes"
            raise UsageError(f"{flag} {path}: {name} is damaged ({where}: {getattr(err, 'msg', err)}); copy it "
                             "again from the model it came from") from err


def read_tokenizer(path: str, trust_remote_code: bool = False, flag: str = "--pretrain", use_fast: bool = True):
    """The tokenizer saved in `path`, as saved (`use_fast` False: --disable_fast_tokenizer, see
    `slow_tokenizer_kwargs`). A directory with no tokenizer files at all is a UsageError naming the directory and
    the files it lacks (transformers would blame a missing sentencepiece or tiktoken package instead); any other
    failure keeps transformers' error."""
    import transformers
    from transformers import AutoTokenizer

    check_local_model(path, flag)
    check_tokenizer_json(path, flag)
    kind = {} if use_fast else slow_tokenizer_kwargs(path, int(transformers.__version__.split(".")[0]))
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True,
                                             **kind)
    except (OSError, ValueError, TypeError) as err:
        if any(_looks_like_vocabulary(name) for name in os.listdir(path)):
            raise
        config = "" if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else \
            "; no tokenizer_config.json either"
        raise UsageError(f"{flag} {path}: this directory holds no tokenizer files (none of "
                         f"{', '.join(TOKENIZER_FILES)}{config}); copy the tokenizer files of the model it was made "
                         f"from into {path}") from err


def load_tokenizer(path: str, trust_remote_code: bool = False, flag: str = "--pretrain", use_fast: bool = True):
    """Tokenizer with a pad token (EOS when the model has none) and right padding (`read_tokenizer`, whose
    errors name `flag`)."""
    tok = read_tokenizer(path, trust_remote_code, flag, use_fast)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def quantization_config(load_in_4bit: bool):
    """transformers' `quantization_config=` for --load_in_4bit (OpenRLHF's QLoRA settings: NF4, double
    quantisation, bf16 compute), or None."""
    if not load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


_SOFTCAP_NOTED: set[str] = set()


SINK_FAMILIES = ("deepseek_v4", "gpt_oss", "granite_swa", "granitemoe_swa", "hy_v4", "mimo_v2_flash",
                 "openai_privacy_filter")
"""transformers 5.19's model types whose attention adds learned sinks (`s_aux` / `sinks`), which the packed and ring
kernels do not implement."""


def check_packed_attention(path: str, attn_implementation: str, trust_remote_code: bool = False,
                           flag: str = "--pretrain") -> None:
    """A UsageError, before any weight loads, when the packed or ring kernels cannot run the model at `path`
    (its family's attention has sinks): naming the family and the flags to drop."""
    if attn_implementation not in ("rlhf_varlen", "rlhf_ring"):
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    model_type = getattr(getattr(config, "text_config", None) or config, "model_type", config.model_type)
    if model_type in SINK_FAMILIES:
        raise UsageError(f"{flag} {path}: {model_type} attention has learned sinks, which the packed and ring "
                         "attention kernels do not implement: drop --packing_samples and --ring_attn_size for this "
                         "model")


def exact_attention(path: str, attn_implementation: str, trust_remote_code: bool = False) -> str:
    """`attn_implementation`, except that "sdpa" for a model that soft-caps attention logits (Gemma-2's
    `attn_logit_softcapping`) becomes "eager": transformers' SDPA attention drops the soft-cap without a word
    (measured on transformers 5.19: Gemma-2 log-probs off by up to 0.33 nats on the zoo's model). Warns once per
    model type. The packed kernels (`rlhf_varlen`, `rlhf_ring`) and flash_attention_2 soft-cap themselves."""
    if attn_implementation != "sdpa":
        return attn_implementation
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    config = getattr(config, "text_config", None) or config
    if getattr(config, "attn_logit_softcapping", None) is None:
        return attn_implementation
    if config.model_type not in _SOFTCAP_NOTED:
        _SOFTCAP_NOTED.add(config.model_type)
        warnings.warn(f"{path}: {config.model_type} soft-caps its attention logits, which PyTorch SDPA attention "
                      "cannot; its padded forwards run transformers' eager attention instead (--packing_samples runs "
                      "the packed kernel, which soft-caps)", stacklevel=2)
    return "eager"


def with_router_aux_loss(model: torch.nn.Module, aux_loss_coef: float, flag: str = "--aux_loss_coef"):
    """`model`, returning its router's load-balancing loss as `aux_loss` when `aux_loss_coef` > 0: transformers'
    mixture-of-experts models compute it only with `config.output_router_logits` (False in Qwen3-MoE's and
    Mixtral's configs), which OpenRLHF sets on every MoE model it trains. A model without a router gets a warning
    (the coefficient then has nothing to scale)."""
    if not aux_loss_coef:
        return model
    config = getattr(model, "config", None)
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = True
    else:
        warnings.warn(f"{flag} {aux_loss_coef} has no effect: {getattr(config, 'model_type', 'this model')} is not a "
                      "mixture-of-experts model (it has no router loss)", stacklevel=2)
    return model


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool = False,
                   load_in_4bit: bool = False):
    """An `AutoModelForCausalLM` in `dtype`, with the KV cache disabled (training-time forwards).
    `load_in_4bit`: linear weights in 4-bit NF4 (QLoRA; CUDA, see `quantization_config`)."""
    from transformers import AutoModelForCausalLM

    check_local_model(path)
    check_packed_attention(path, attn_implementation, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=exact_attention(path, attn_implementation, trust_remote_code),
        trust_remote_code=trust_remote_code,
        local_files_only=True, quantization_config=quantization_config(load_in_4bit),
    )
    model.config.use_cache = False
    return model


def check_liger_kernel() -> None:
    """ValueError naming --use_liger_kernel unless Liger can run here (CUDA and the package)."""
    if not torch.cuda.is_available():
        raise ValueError("--use_liger_kernel needs CUDA: Liger's kernels are GPU Triton kernels; drop the flag "
                         "on CPU")
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as err:
        raise ValueError("--use_liger_kernel needs the liger-kernel package: pip install liger-kernel "
                         "(bash launch/install.sh gpu installs it)") from err


def apply_liger_kernel(model: torch.nn.Module) -> torch.nn.Module:
    """Patch a loaded model in place with Liger's fused Triton kernels where its architecture has them
    (RMSNorm, RoPE, SwiGLU MLP). The output layer is left alone: the trainer needs per-token log-probs
    (from `rlhf.kernels`), not Liger's fused cross-entropy loss. CUDA only (`--use_liger_kernel`)."""
    check_liger_kernel()
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    base = getattr(model, "base", model)  # a ScalarHeadModel patches its transformer
    _apply_liger_kernel_to_instance(model=base, cross_entropy=False, fused_linear_cross_entropy=False)
    return model


def flash_attn_available() -> bool:
    """Whether flash-attn can run here: CUDA and the flash-attn package."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_attention(name: str, flag: str) -> str:
    """The attention implementation to load models with: `name`, except that flash_attention_2 where
    flash-attn cannot run becomes PyTorch SDPA (same results, slower), with a warning naming `flag`."""
    if name != "flash_attention_2" or flash_attn_available():
        return name
    why = "flash-attn is not installed" if torch.cuda.is_available() else "there is no CUDA device"
    warnings.warn(f"{flag}: {why}, so attention runs on PyTorch SDPA instead of flash-attn "
                  "(pass --attn_implementation sdpa to silence this)", stacklevel=2)
    return "sdpa"
