"""A small HTTP reward server: `python -m rlhf.cli.serve_rm --reward_pretrain DIR[,DIR] --port 5000`
or `--remote_rm_url reward.py`. Answers POST /get_reward with {"rewards": [...]} for
{"query": [...], "prompts": [...], "labels": [...]} (what `--remote_rm_url http://host:port/get_reward`
sends). Single process, CPU or one GPU; for tests and small deployments. Models load as OpenRLHF v0.9.5's serve_rm
loads them, with its flags and defaults (`ModelLoading`); --host and --batch_size keep safer defaults (their help).

The HTTP side (answers, limits, slow clients): `rlhf.rewards.reward_server`."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from rlhf.config.flags import IGNORED_FLAGS
from rlhf.config.shared_config import PARAM_DTYPES
from rlhf.models.lora import check_4bit
from rlhf.rewards import reward_server
from rlhf.rewards.base import RewardSource
from rlhf.rewards.remote import API_KEY_ENV
from rlhf.rewards.reward_func import RewardFuncFile
from rlhf.rewards.reward_server import RewardServer, ServerLimits

if TYPE_CHECKING:
    from rlhf.models.layout import SequenceLayout

HTTP_BEHAVIOUR = reward_server.__doc__.split("\n\n", 1)[1]
"""The server's answers and limits (reward_server's docstring less its first paragraph), for --help."""

MODEL_FLAGS = ("param_dtype", "bf16", "attn_implementation", "disable_fast_tokenizer", "load_in_4bit",
               "packing_samples")
"""The flags that say how reward models are loaded (`ModelLoading`); they mean nothing to --remote_rm_url."""

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flex_attention")
"""--attn_implementation's choices (the training jobs' set)."""


@dataclass(frozen=True, kw_only=True)
class ModelLoading:
    """How the reward models are loaded and run. The defaults are for callers in-process (exact fp32, SDPA);
    the command line's are OpenRLHF v0.9.5's (bf16, flash_attention_2), checked against this machine by
    `model_loading`."""

    param_dtype: str = "fp32"
    """dtype of the models' weights: bf16, fp16 or fp32 (--param_dtype; --bf16 is bf16)"""
    attn_implementation: str = "sdpa"
    """transformers attention the models are built with, as this machine runs it (--attn_implementation);
    unused with packing_samples"""
    use_fast_tokenizer: bool = True
    """False: --disable_fast_tokenizer (`rlhf.models.loading.slow_tokenizer_kwargs`)"""
    load_in_4bit: bool = False
    """the base weights in 4-bit NF4, computing in bf16 (--load_in_4bit; CUDA and bitsandbytes)"""
    packing_samples: bool = False
    """each micro-batch packed into one padding-free row, run with the packed varlen attention (--packing_samples)"""

    def __post_init__(self) -> None:
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"--param_dtype {self.param_dtype!r}: choose bf16, fp16 or fp32")
        if self.load_in_4bit and self.param_dtype != "bf16":
            raise ValueError(f"--load_in_4bit computes in bf16: drop --param_dtype {self.param_dtype} "
                             "(bf16 is the default)")

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.param_dtype]

    @property
    def layout(self) -> SequenceLayout:
        from rlhf.models.layout import SequenceLayout

        return SequenceLayout(packing=self.packing_samples)

    @property
    def attn(self) -> str:
        """The implementation to build the models with: the packed varlen attention with --packing_samples."""
        return self.layout.attn_implementation(self.attn_implementation)


def model_loading(args: argparse.Namespace) -> ModelLoading:
    """The model flags as this machine runs them; ValueError naming the flag for a contradiction or what this
    machine cannot run (fp16 and 4-bit need CUDA, 4-bit bitsandbytes). flash_attention_2 without CUDA and
    flash-attn runs SDPA, and a flag that changes nothing on this path gets a note (both as warnings)."""
    from rlhf.models.loading import resolve_attention

    if args.bf16 and args.param_dtype != "bf16":
        raise ValueError(f"--bf16 contradicts --param_dtype {args.param_dtype}: give one of them")
    packing = args.packing_samples and not args.prm
    load = ModelLoading(param_dtype=args.param_dtype, attn_implementation=args.attn_implementation,
                        use_fast_tokenizer=not args.disable_fast_tokenizer, load_in_4bit=args.load_in_4bit,
                        packing_samples=packing)
    if load.param_dtype == "fp16" and not torch.cuda.is_available():
        raise ValueError("--param_dtype fp16 needs CUDA (CPU half-precision kernels are slow and incomplete); on "
                         "CPU pass --param_dtype bf16 (the default) or --param_dtype fp32")
    if load.load_in_4bit:
        check_4bit()
    if args.packing_samples and args.prm:
        warnings.warn("--packing_samples is ignored with --prm: the process reward model scores padded rows",
                      stacklevel=2)
    flag = f"--attn_implementation {args.attn_implementation}"
    if packing:  # packed rows run the varlen attention whatever was asked
        if args.attn_implementation != "flash_attention_2":
            warnings.warn(f"{flag} has no effect with --packing_samples: packed rows run the packed varlen "
                          "attention (flash-attn where it runs, else PyTorch's kernels)", stacklevel=2)
        return load
    default = " (the default)" if args.attn_implementation == "flash_attention_2" else ""
    return replace(load, attn_implementation=resolve_attention(args.attn_implementation, flag + default))


def warn_unused_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """One note per flag that changes nothing here: --use_ms (nothing is downloaded), and with --remote_rm_url
    every model flag given (no model is loaded)."""
    if args.use_ms:
        warnings.warn(f"--use_ms is ignored: {IGNORED_FLAGS['use_ms']}", stacklevel=2)
    if args.remote_rm_url:
        for flag in (f for f in MODEL_FLAGS if getattr(args, f) != parser.get_default(f)):
            warnings.warn(f"--{flag} is ignored with --remote_rm_url: no reward model is loaded", stacklevel=2)


def build_source(args: argparse.Namespace, load: ModelLoading = ModelLoading()) -> tuple[RewardSource, object | None]:
    """The reward source the flags name and its tokenizer (None for --remote_rm_url, which gets the texts)."""
    if args.remote_rm_url:  # one call per request, abandoned after --max_score_s (it runs on in a daemon thread)
        return RewardFuncFile(args.remote_rm_url, timeout_s=args.max_score_s), None
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.models.value import load_scalar_head_model, stored_reward_norm
    from rlhf.rewards.models import RewardModelEnsemble

    paths = [p for p in args.reward_pretrain.split(",") if p]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.prm:
        return build_prm_source(args, paths, device, load)
    models = [_placed(load_scalar_head_model(p, args.value_head_prefix, load.dtype, load.attn,
                                             load_in_4bit=load.load_in_4bit), device, load) for p in paths]
    norms = None
    if args.normalize_reward:
        norms = [stored_reward_norm(p) for p in paths]
        missing = [p for p, n in zip(paths, norms) if n is None]
        if missing:
            raise ValueError(f"--normalize_reward: {', '.join(missing)} stores no reward mean/std (train_rm writes "
                             "them when it evaluates); drop --normalize_reward to serve raw rewards")
    batcher = MicroBatcher(args.batch_size, layout=load.layout)
    tokenizer = load_tokenizer(paths[0], flag="--reward_pretrain", use_fast=load.use_fast_tokenizer)
    return RewardModelEnsemble(models, device, batcher, norms), tokenizer


def _placed(model: torch.nn.Module, device: torch.device, load: ModelLoading) -> torch.nn.Module:
    """`model` on `device`, in inference mode. A 4-bit base is on the GPU already (transformers places quantised
    weights when it loads them); only the head, built on the host, moves."""
    if load.load_in_4bit:
        model.head.to(device)
    else:
        model.to(device)
    return model.eval()


def build_prm_source(args: argparse.Namespace, paths: list[str], device: torch.device,
                     load: ModelLoading) -> tuple[RewardSource, object]:
    """A process reward model (one causal LM from train_prm) scoring the steps marked by the placeholder."""
    from rlhf.data.supervised_samples import token_id
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.process_rewards import ProcessRewardSource

    if args.normalize_reward:
        raise ValueError("--normalize_reward applies reward-model statistics; a process reward model's step "
                         "scores are probabilities and have none: drop one of --prm / --normalize_reward")
    if len(paths) != 1 or not args.placeholder_token or not args.reward_tokens:
        raise ValueError("--prm serves one process reward model: give one --reward_pretrain directory, "
                         "--placeholder_token and --reward_tokens (the positive token first)")
    assert not load.packing_samples, "model_loading turns packing off for --prm"
    tokenizer = load_tokenizer(paths[0], flag="--reward_pretrain", use_fast=load.use_fast_tokenizer)
    model = load_causal_lm(paths[0], load.dtype, load.attn, load_in_4bit=load.load_in_4bit)
    if not load.load_in_4bit:  # transformers has placed a 4-bit model on the GPU
        model.to(device)
    return ProcessRewardSource(model.eval(), device,
                               token_id(tokenizer, args.placeholder_token, "--placeholder_token"),
                               [token_id(tokenizer, t, "--reward_tokens") for t in args.reward_tokens],
                               args.prm_reduction, args.batch_size), tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.reward_pretrain) == bool(args.remote_rm_url):
        parser.error("give exactly one of --reward_pretrain or --remote_rm_url")
    if args.batch_size < 1:
        parser.error(f"--batch_size {args.batch_size}: give at least 1 (queries per forward and per turn at the "
                     "model)")
    try:
        limits = ServerLimits(max_request_mb=args.max_request_mb, request_timeout_s=args.request_timeout,
                              max_connections=args.max_connections, max_connections_per_ip=args.max_connections_per_ip,
                              max_queries=args.max_queries, max_score_s=args.max_score_s,
                              slow_client_s=args.slow_client_s)
    except ValueError as err:
        parser.error(str(err))
    try:
        check_port_free(args.host, args.port)  # before the model loads: a busy port is known at once
        with notes_to_stderr():
            warn_unused_flags(args, parser)
            source, tokenizer = build_source(args, ModelLoading() if args.remote_rm_url else model_loading(args))
        server = RewardServer((args.host, args.port), source, tokenizer, limits=limits, max_len=args.max_len,
                              score_chunk=args.batch_size if tokenizer is not None else 0,
                              api_key=args.api_key or os.environ.get(API_KEY_ENV))
    except OSError as err:  # the port was taken while the model loaded
        print(f"error: {port_error(args.host, args.port, err)}", file=sys.stderr)
        sys.exit(2)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    auth = "bearer token required" if server.api_key else "no authentication (set --api_key or " + API_KEY_ENV + ")"
    print(f"serving rewards on http://{args.host}:{server.server_address[1]}/get_reward ({auth})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def port_error(host: str, port: int, err: OSError) -> str:
    return (f"--host {host} --port {port}: cannot listen there ({err.strerror or err}); stop what listens on that "
            "port or pick another --port")


def check_port_free(host: str, port: int) -> None:
    """Bind `host:port` once, as the server will (address reuse on, as http.server sets it), and let it go: a port
    another process listens on, or an address this machine does not have, is a ValueError naming both."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen(1)
        except OSError as err:
            raise ValueError(port_error(host, port, err)) from err


@contextlib.contextmanager
def notes_to_stderr():
    """Warnings raised inside, printed once each as `Category: message` lines on stderr (as the training jobs
    print their notes), after the block; also when it raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        finally:
            for w in caught:
                print(f"{w.category.__name__}: {w.message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """serve_rm's flags: OpenRLHF v0.9.5's serve_rm flags (defaults as there, but for --host and --batch_size,
    whose help says why) and ours (--remote_rm_url, --prm, the limits, --api_key)."""
    parser = argparse.ArgumentParser(prog="python -m rlhf.cli.serve_rm", description=f"{__doc__}\n\n{HTTP_BEHAVIOUR}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward_pretrain", default=None, help="reward model directories, comma separated")
    parser.add_argument("--remote_rm_url", default=None, help="a .py file defining reward_func instead")
    parser.add_argument("--value_head_prefix", default="score")
    add_model_flags(parser)
    parser.add_argument("--prm", action="store_true",
                        help="--reward_pretrain is a process reward model (train_prm): score each step at its "
                             "--placeholder_token, reduce over steps with --prm_reduction")
    parser.add_argument("--placeholder_token", default=None, help="with --prm: the token after each step")
    parser.add_argument("--reward_tokens", nargs="*", default=None,
                        help="with --prm: the reward tokens, the positive one first")
    parser.add_argument("--prm_reduction", default="min", choices=("min", "mean", "last"),
                        help="with --prm: one reward per sample from its step scores")
    parser.add_argument("--normalize_reward", action="store_true",
                        help="serve (reward - mean) / std with the statistics stored by train_rm")
    parser.add_argument("--max_len", type=int, default=2048,
                        help="tokens per query (default %(default)s, as OpenRLHF); longer queries are cut to it")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="queries per model forward, and per turn at the scoring lock (default %(default)s; "
                             "OpenRLHF's default is the whole request in one forward, which a large request runs "
                             "out of memory with and which would hold the model past --max_score_s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default %(default)s: this machine only, because the server "
                             "has no authentication unless --api_key is set; OpenRLHF binds 0.0.0.0: pass --host "
                             "0.0.0.0 with --api_key to serve other machines)")
    parser.add_argument("--port", type=int, default=5000)
    add_limit_flags(parser)
    parser.add_argument("--api_key", default=None,
                        help=f"require 'Authorization: Bearer <key>' (default: env {API_KEY_ENV}; the env var "
                             "keeps the key out of the process list)")
    parser.add_argument("--use_ms", action="store_true",
                        help=f"accepted and ignored, with a note: {IGNORED_FLAGS['use_ms']}")
    return parser


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The `ModelLoading` flags, with OpenRLHF v0.9.5's defaults (bf16, flash_attention_2)."""
    parser.add_argument("--param_dtype", default="bf16", choices=PARAM_DTYPES,
                        help="dtype of the reward models (default %(default)s, as OpenRLHF; fp16 needs CUDA; fp32, "
                             "ours, scores exactly)")
    parser.add_argument("--bf16", action="store_true", help="same as --param_dtype bf16 (older OpenRLHF scripts)")
    parser.add_argument("--attn_implementation", default="flash_attention_2", choices=ATTN_IMPLEMENTATIONS,
                        help="transformers attention (default %(default)s; without CUDA and flash-attn: SDPA, with "
                             "a warning; with --packing_samples the packed varlen attention runs)")
    parser.add_argument("--disable_fast_tokenizer", action="store_true",
                        help="load the slow (Python/sentencepiece) tokenizer instead of the fast one")
    parser.add_argument("--load_in_4bit", action="store_true",
                        help="load the base weights in 4-bit NF4, computing in bf16 (bitsandbytes; CUDA only)")
    parser.add_argument("--packing_samples", action="store_true",
                        help="pack each --batch_size chunk into one padding-free row (varlen attention: flash-attn "
                             "on CUDA, exact per-sequence SDPA on CPU); same scores, less padding")


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The `ServerLimits` flags, defaults from its fields."""
    d = ServerLimits()
    parser.add_argument("--max_request_mb", type=float, default=d.max_request_mb,
                        help="larger bodies get HTTP 413 (default %(default)s)")
    parser.add_argument("--request_timeout", type=float, default=d.request_timeout_s,
                        help="seconds (default %(default)s) from connecting to receive the whole request, headers and "
                             "body (one deadline); a late body gets HTTP 408, late headers a closed connection")
    parser.add_argument("--max_connections", type=int, default=d.max_connections,
                        help="concurrent connections (handler threads, default %(default)s); beyond them, when all "
                             "are trusted, HTTP 503")
    parser.add_argument("--max_connections_per_ip", type=int, default=d.max_connections_per_ip,
                        help="pending connections (the bearer token, or without --api_key the whole request, not yet "
                             "received) kept per source IP (default %(default)s); one more closes that IP's oldest "
                             "slow one (--slow_client_s)")
    parser.add_argument("--slow_client_s", type=float, default=d.slow_client_s,
                        help="seconds (default %(default)s) a connection may stay pending before it counts as slow "
                             "and may be closed to make room for a newcomer")
    parser.add_argument("--max_queries", type=int, default=d.max_queries,
                        help="queries per request (default %(default)s); more get HTTP 413")
    parser.add_argument("--max_score_s", type=float, default=d.max_score_s,
                        help="seconds of scoring per request (default %(default)s; checked between --batch_size "
                             "chunks; a reward_func call is abandoned); past it the rest gets HTTP 413")

if __name__ == "__main__":
    main()
