"""Merge a LoRA adapter into its base model and save a plain HF model:

    python -m rlhf.cli.lora_combiner --model_path BASE --lora_path ADAPTER --output_path OUT [--is_rm]

OpenRLHF's `lora_combiner` flags and defaults (--param_dtype bf16). The adapter is what a --lora_rank run saves
under --save_path. With --is_rm the base gets a scalar head (`rlhf.models.value`) whose trained weights come
from the adapter, and the output is the sequence-classification checkpoint train_rm writes (it loads with
`AutoModelForSequenceClassification` and as --reward_pretrain / --critic_pretrain). One process, no GPU needed.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from rlhf.config.errors import UsageError, usage_errors_exit
from rlhf.config.shared_config import PARAM_DTYPES
from rlhf.models.loading import check_local_model
from rlhf.models.lora import merge_adapter, read_adapter_config

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
    return parser.parse_args(argv)


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

    base = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype, local_files_only=True,
                                                trust_remote_code=args.trust_remote_code)
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
    args = parse_args(argv)
    with usage_errors_exit():
        if args.bf16 and args.param_dtype != "bf16":
            raise UsageError(f"--bf16 contradicts --param_dtype {args.param_dtype}: give one of them")
        check_local_model(args.model_path, "--model_path")
        adapter_config = read_adapter_config(args.lora_path)
        if os.path.abspath(args.output_path) in (os.path.abspath(args.model_path), os.path.abspath(args.lora_path)):
            raise UsageError(f"--output_path {args.output_path} would overwrite an input: give a new directory")
        from transformers import AutoTokenizer

        dtype = DTYPES[args.param_dtype]
        print(f"merging the adapter {args.lora_path} into {args.model_path} ({args.param_dtype})", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True,
                                                  trust_remote_code=args.trust_remote_code)
        if args.is_rm:
            combine_reward_model(args, dtype, adapter_config, tokenizer)
        else:
            combine_causal_lm(args, dtype, adapter_config)
            tokenizer.save_pretrained(args.output_path)
        print(f"saved the merged model to {args.output_path}", flush=True)


if __name__ == "__main__":
    main()
