"""Merge a LoRA adapter into its base model and save a plain HF model:

    python -m rlhf.cli.lora_combiner --model_path BASE --lora_path ADAPTER --output_path OUT [--is_rm]

OpenRLHF's `lora_combiner` flags and defaults (--param_dtype bf16). The adapter is what a --lora_rank run saves
under --save_path. With --is_rm the base gets a scalar head (`rlhf.models.value`) whose trained weights come
from the adapter, and the output is the sequence-classification checkpoint train_rm writes (it loads with
`AutoModelForSequenceClassification` and as --reward_pretrain / --critic_pretrain). One process, no GPU needed;
under torchrun only rank 0 merges and writes (the other ranks return at once).

Before loading anything it checks --model_path against the base the adapter records: the architecture and shapes
of the config.json saved beside the adapter, and the weights fingerprint of `adapter_base.json`
(`rlhf.models.lora.weights_fingerprint`; for an adapter saved elsewhere, the fingerprint of the directory its
adapter_config.json names, when that exists here); and --is_rm against the kind of adapter. A causal LM that
would come out with randomly initialised weights (a reward model's directory has no lm_head) is refused too.
Each mismatch is one error line naming both sides and the fix; --force merges anyway, printing them as warnings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from rlhf.config.errors import UsageError, launch_rank, usage_errors_exit
from rlhf.config.shared_config import PARAM_DTYPES
from rlhf.models.loading import check_local_model, read_tokenizer
from rlhf.models.lora import merge_adapter, read_adapter_config, read_base_record, weights_fingerprint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf.cli.lora_combiner", allow_abbrev=False,
                                     description="Merge a LoRA adapter into its base model and save the result.")
    parser.add_argument("--model_path", required=True, help="HF directory of the base model the adapter was "
                        "trained on (the run's --pretrain; for --is_rm its --pretrain or --critic_pretrain)")
    parser.add_argument("--lora_path", required=True, help="directory of the adapter (adapter_config.json)")
    parser.add_argument("--output_path", required=True, help="directory to write the merged model to")
    parser.add_argument("--is_rm", action="store_true", help="the adapter is a reward model's or critic's (with "
                        "its value head): write a sequence-classification checkpoint")
    parser.add_argument("--param_dtype", default="bf16", choices=PARAM_DTYPES, help="dtype of the merged weights")
    parser.add_argument("--bf16", action="store_true", help="same as --param_dtype bf16 (older OpenRLHF scripts)")
    parser.add_argument("--value_head_prefix", default=None, help="with --is_rm: the scalar head's name (default: "
                        "the module the adapter saves whole, else score)")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow code shipped with the model")
    parser.add_argument("--force", action="store_true", help="merge even when --model_path is not the base the "
                        "adapter records (architecture, shapes, weights) or --is_rm does not fit the adapter; the "
                        "mismatches are printed as warnings")
    return parser.parse_args(argv)


SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim")
"""config.json entries that set a base model's tensor shapes, compared between the adapter's base and --model_path."""


def _read_config(path: str) -> dict | None:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def recorded_base(args: argparse.Namespace, adapter_config: dict) -> str | None:
    """Where the adapter's base came from: `adapter_base.json`'s path, else adapter_config.json's."""
    return read_base_record(args.lora_path).get("base_model_name_or_path") or \
        adapter_config.get("base_model_name_or_path")


def _fix(base: str | None) -> str:
    known = f"pass --model_path {base}, the base the adapter was trained on" if base else \
        "pass the base model the adapter was trained on as --model_path"
    return f"{known}, or --force to merge anyway"


def kind_problem(args: argparse.Namespace, adapter_config: dict) -> str | None:
    """--is_rm against the adapter's kind: a causal LM's (peft task_type CAUSAL_LM) or a reward model's or
    critic's (it saves its value head whole, `modules_to_save`); None when they fit or the kind is unknown."""
    heads = adapter_config.get("modules_to_save") or []
    scalar = heads or (adapter_config.get("auto_mapping") or {}).get("base_model_class") == "ScalarHeadModel"
    if args.is_rm and adapter_config.get("task_type") == "CAUSAL_LM" and not heads:
        return (f"--is_rm, but --lora_path {args.lora_path} is a causal LM's adapter (task_type CAUSAL_LM, no value "
                "head saved): drop --is_rm to merge it into its causal LM, or pass the reward model's or critic's "
                "adapter, or --force to merge anyway")
    if not args.is_rm and scalar:
        return (f"--lora_path {args.lora_path} is a reward model's or critic's adapter (it saves the value head "
                f"{', '.join(heads) or 'of a ScalarHeadModel'}), but --is_rm is not given: add --is_rm to write a "
                "sequence classifier (a causal LM would lose the head), or --force to merge anyway")
    return None


def architecture_problem(args: argparse.Namespace, base: str | None) -> str | None:
    """The architecture and `SHAPE_KEYS` of the config.json saved beside the adapter (its base's) against
    --model_path's; None when they agree or the adapter has no config.json."""
    trained, given = _read_config(args.lora_path), _read_config(args.model_path) or {}
    if trained is None:
        return None
    trained_arch, given_arch = trained.get("architectures"), given.get("architectures")
    if trained_arch and given_arch and trained_arch != given_arch:
        return (f"--lora_path {args.lora_path} was trained on a {', '.join(trained_arch)} ({base or 'path unknown'}), "
                f"but --model_path {args.model_path} is a {', '.join(given_arch)}: {_fix(base)}")
    differ = [f"{k} {trained[k]} vs {given[k]}" for k in SHAPE_KEYS if k in trained and k in given and
              trained[k] != given[k]]
    if differ:
        return (f"--lora_path {args.lora_path} was trained on a base of other shapes than --model_path "
                f"{args.model_path} ({'; '.join(differ)}; the adapter's base first): {_fix(base)}")
    return None


def _same_directory(a: str | None, b: str) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def weights_problem(args: argparse.Namespace, base: str | None) -> str | None:
    """The weights fingerprint `save_adapter` recorded (for an adapter saved elsewhere: the fingerprint of the
    directory adapter_config.json names, when it exists here and is not --model_path) against --model_path's.
    None when they agree; a warning when there is nothing to compare."""
    want = read_base_record(args.lora_path).get("weights_fingerprint")
    if want is None and base and os.path.isdir(base) and not _same_directory(base, args.model_path):
        want = weights_fingerprint(base)
    got = weights_fingerprint(args.model_path) if want is not None else None
    if want is None or got is None:
        if not _same_directory(base, args.model_path):
            print(f"warning: cannot check that --model_path {args.model_path} holds the weights --lora_path "
                  f"{args.lora_path} was trained on (the adapter records the base {base or '(none)'} without a "
                  "fingerprint, or one of them has no safetensors files)", file=sys.stderr, flush=True)
        return None
    if got == want:
        return None
    return (f"--lora_path {args.lora_path} was trained on {base or 'another base'} (weights fingerprint "
            f"{want[:12]}), but --model_path {args.model_path} holds other weights ({got[:12]}): {_fix(base)}")


def refuse_or_warn(problem: str | None, force: bool) -> None:
    """UsageError for `problem`; with --force a warning line instead."""
    if problem is None:
        return
    if not force:
        raise UsageError(problem)
    print(f"warning: {problem.removesuffix(', or --force to merge anyway')} (--force: merging anyway)",
          file=sys.stderr, flush=True)


def check_base(args: argparse.Namespace, adapter_config: dict) -> None:
    """Refuse (or with --force, warn about) an adapter whose kind does not fit --is_rm, or whose recorded base
    differs from --model_path in architecture, shapes or weights. Reads configs and a few rows a tensor."""
    base = recorded_base(args, adapter_config)
    refuse_or_warn(kind_problem(args, adapter_config), args.force)
    refuse_or_warn(architecture_problem(args, base), args.force)
    refuse_or_warn(weights_problem(args, base), args.force)


def head_prefix(adapter_config: dict, given: str | None) -> str:
    """The value head's name: --value_head_prefix, else the one module the adapter saves whole, else score."""
    if given:
        return given
    saved = adapter_config.get("modules_to_save") or []
    return saved[0] if len(saved) == 1 else "score"


def _merged(base: torch.nn.Module, args: argparse.Namespace, adapter_config: dict) -> torch.nn.Module:
    try:
        return merge_adapter(base, args.lora_path)
    except (RuntimeError, ValueError, KeyError) as err:
        trained_on = adapter_config.get("base_model_name_or_path")
        raise UsageError(f"--lora_path {args.lora_path} does not fit --model_path {args.model_path} ({err}); pass "
                         f"the base model the adapter was trained on"
                         + (f" (its adapter_config.json names {trained_on})" if trained_on else "")) from err


def combine_causal_lm(args: argparse.Namespace, dtype: torch.dtype, adapter_config: dict) -> None:
    from transformers import AutoModelForCausalLM

    base, info = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype, local_files_only=True,
                                                      trust_remote_code=args.trust_remote_code,
                                                      output_loading_info=True)
    missing = sorted(info["missing_keys"])
    if missing:  # transformers initialises them randomly (a reward model's directory has no lm_head)
        refuse_or_warn(f"--model_path {args.model_path} has no {', '.join(missing[:3])}"
                       f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''} for a causal LM, so the "
                       "merged model would hold random weights there: pass the causal LM the adapter was trained on, "
                       "or --is_rm for a reward model's or critic's adapter, or --force to merge anyway", args.force)
    _merged(base, args, adapter_config).save_pretrained(args.output_path, safe_serialization=True)


def combine_reward_model(args: argparse.Namespace, dtype: torch.dtype, adapter_config: dict, tokenizer) -> None:
    from rlhf.models.value import checkpoint_keys, load_scalar_head_model, save_scalar_head_model

    head = head_prefix(adapter_config, args.value_head_prefix)
    if head not in (adapter_config.get("modules_to_save") or []) and f"{head}.weight" not in \
            checkpoint_keys(args.model_path):
        raise UsageError(f"--is_rm: neither --lora_path {args.lora_path} (modules_to_save "
                         f"{adapter_config.get('modules_to_save')}) nor --model_path {args.model_path} holds the value "
                         f"head '{head}.weight'; pass its name with --value_head_prefix")
    base = load_scalar_head_model(args.model_path, head, dtype, "sdpa", args.trust_remote_code, "--model_path",
                                  fresh_head=True)
    model = _merged(base, args, adapter_config)
    extra = {}
    config_file = os.path.join(args.lora_path, "config.json")
    if os.path.isfile(config_file):  # the reward mean/std that reward-model training stores
        with open(config_file) as f:
            extra = {k: v for k, v in json.load(f).items() if k in ("mean", "std")}
    state = {k: v.detach() for k, v in model.state_dict().items()}
    save_scalar_head_model(state, model.config, head, args.output_path, tokenizer, extra)


def main(argv: list[str] | None = None) -> None:
    rank = launch_rank()
    if rank != 0:  # under torchrun or srun: one merged model, written by rank 0
        print(f"rank {rank}: nothing to do (rank 0 merges and writes the model)", flush=True)
        return
    args = parse_args(argv)
    with usage_errors_exit():
        if args.bf16 and args.param_dtype != "bf16":
            raise UsageError(f"--bf16 contradicts --param_dtype {args.param_dtype}: give one of them")
        check_local_model(args.model_path, "--model_path")
        adapter_config = read_adapter_config(args.lora_path)
        if os.path.abspath(args.output_path) in (os.path.abspath(args.model_path), os.path.abspath(args.lora_path)):
            raise UsageError(f"--output_path {args.output_path} would overwrite an input: give a new directory")
        check_base(args, adapter_config)
        dtype = DTYPES[args.param_dtype]
        print(f"merging the adapter {args.lora_path} into {args.model_path} ({args.param_dtype})", flush=True)
        tokenizer = read_tokenizer(args.model_path, args.trust_remote_code, "--model_path")
        if args.is_rm:
            combine_reward_model(args, dtype, adapter_config, tokenizer)
        else:
            combine_causal_lm(args, dtype, adapter_config)
            tokenizer.save_pretrained(args.output_path)
        print(f"saved the merged model to {args.output_path}", flush=True)


if __name__ == "__main__":
    main()
