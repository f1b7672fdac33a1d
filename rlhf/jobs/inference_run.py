"""Batch inference's run (`InferenceRun` and `run`): the entry point, its flags and its output are described in
`rlhf.cli.batch_inference`."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError
from rlhf.config.inference_config import DEMO_LENGTHS, BatchInferenceConfig
from rlhf.config.shared_config import EngineConfig, LoggingConfig
from rlhf.core.role_models import check_model_configs
from rlhf.core.run import RunParts, check_writable, start
from rlhf.distributed.launch_env import LaunchEnv, finish_distributed
from rlhf.distributed.topology import Placement, Role, Topology, plan_ranks
from rlhf.inference.generate import (
    ChunkGenerator,
    build_engine,
    check_engine_available,
    load_generation_prompts,
    rollout_tp_size,
    sampling_spec,
)
from rlhf.inference.output import (
    ChunkedJsonlWriter,
    fingerprint,
    num_chunks,
    progress_path,
    run_chunks,
    write_atomically,
)
from rlhf.inference.post_process import post_process, reward_stats
from rlhf.inference.score import ChunkScorer, build_scorer, head_prefix, load_scoring_samples
from rlhf.models.loading import check_local_model, load_tokenizer
from rlhf.models.value import check_scalar_head
from rlhf.utils import watchdog
from rlhf.utils.preemption import PreemptionWatch
from rlhf.utils.seeding import seed_everything

PREEMPTED_EXIT_CODE = 75
"""Exit status after a stop at a chunk boundary (EX_TEMPFAIL): the output is incomplete, rerun to continue.
Not 0, so a pipeline script does not take the partial file for the stage's result."""

_UNFINGERPRINTED = ("verbose", "dist_timeout", "watchdog_interval")
"""Settings that change how a run is watched, not the rows it writes: a rerun may change them and resume."""


def work_path(cfg: BatchInferenceConfig) -> str:
    """The file the chunks go to: --output_path itself, or with a post-processor the scored rows beside it
    (`OUTPUT_PATH.scored.jsonl`, kept), from which --output_path is written at the end."""
    out = cfg.data.output_path
    return out + ".scored.jsonl" if cfg.eval_task == "rm" and cfg.scoring.processor else out


def check_before_engines(cfg: BatchInferenceConfig, world_size: int) -> int:
    """Flags, model files and the output, before any engine or process group starts; returns the ranks per
    engine."""
    m, d, g = cfg.model, cfg.data, cfg.generation
    check_local_model(m.pretrain, "--pretrain")
    if cfg.eval_task == "rm":
        check_scalar_head(m.pretrain, head_prefix(m.pretrain, m.value_head_prefix), "--pretrain")
        longest, flags = d.max_len, f"--max_len {d.max_len}"
    else:
        longest, flags = g.prompt_max_len + g.max_new_tokens, (f"--prompt_max_len {g.prompt_max_len} + "
                                                               f"--max_new_tokens {g.max_new_tokens}")
    check_model_configs([("--pretrain", m.pretrain)], m, EngineConfig(), longest=longest, length_flags=flags)
    check_engine_available(cfg)
    out = os.path.abspath(d.output_path)
    if out in {os.path.abspath(s.strip()) for s in d.dataset.split(",")}:
        raise UsageError(f"--output_path {d.output_path} is also read as --dataset: write to another file")
    check_writable("--output_path", os.path.dirname(out))
    return rollout_tp_size(cfg, world_size)


def run_fingerprint(cfg: BatchInferenceConfig, tp_size: int) -> str:
    """What the rows depend on: the settings (and the vLLM engines' tensor parallelism, which changes their
    arithmetic) and the model and data files (not this run's own output, progress record and logs, which may
    sit in the model's directory as in OpenRLHF's rejection-sampling script)."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _UNFINGERPRINTED}
    settings["tp_size"] = tp_size
    out = os.path.abspath(cfg.data.output_path)
    own = [out, os.path.join(os.path.dirname(out), "logs") + os.sep]  # this run's files, and its logs (`begin`)
    return fingerprint(settings, [cfg.model.pretrain, *(s.strip() for s in cfg.data.dataset.split(","))], own)


def open_output(cfg: BatchInferenceConfig, num_items: int, tp_size: int) -> tuple[ChunkedJsonlWriter, bool]:
    """The writer of global rank 0, lined up with an earlier run of the same inputs (or started afresh), and
    whether that run already finished."""
    writer = ChunkedJsonlWriter(work_path(cfg), run_fingerprint(cfg, tp_size), num_chunks(num_items, cfg.chunk_size),
                                record_path=progress_path(cfg.data.output_path))
    recorded = writer.read_progress()
    if recorded is not None and recorded.complete and os.path.isfile(cfg.data.output_path):
        return writer, True
    progress = writer.resume()
    if progress.chunks_done:
        print(f"resuming {writer.path}: {progress.chunks_done} of {progress.num_chunks} chunks ({progress.num_rows} "
              "rows) were written by an earlier run with the same inputs", flush=True)
    return writer, False


def _describe(cfg: BatchInferenceConfig, num_items: int, topology: Topology) -> str:
    n, out = cfg.generation.best_of_n, cfg.data.output_path
    if cfg.eval_task == "rm":
        post = f", then --post_processor {cfg.scoring.processor}" if cfg.scoring.processor else ""
        return (f"batch_inference rm: scoring {num_items} rows on {topology.world_size} rank(s), chunks of "
                f"{cfg.chunk_size} rows{post} -> {out}")
    engine = "vLLM" if cfg.eval_task == "generate_vllm" else "HF generate"
    return (f"batch_inference {cfg.eval_task}: {num_items} prompts x {n} sample{'s' if n > 1 else ''} on "
            f"{topology.num_engines} {engine} engine(s) of {topology.rollout_tp} rank(s), chunks of {cfg.chunk_size} "
            f"prompts -> {out}")


def _demo_line(cfg: BatchInferenceConfig) -> str:
    if cfg.eval_task == "rm":
        return ("no --pretrain given: scoring with the embedded tiny reward model (--max_len "
                f"{DEMO_LENGTHS['max_len']} unless given)")
    return ("no --pretrain given: generating with the embedded tiny demo policy (--prompt_max_len "
            f"{DEMO_LENGTHS['prompt_max_len']} --max_new_tokens {DEMO_LENGTHS['max_new_tokens']} unless given)")


def _chunk_fn(cfg: BatchInferenceConfig, items: list, topology: Topology, device: torch.device,
              tokenizer) -> Callable[[range], list[dict]]:
    """The collective that turns a chunk of items into rows (rows on rank 0), with this rank's engine."""
    if cfg.eval_task == "rm":
        return ChunkScorer(build_scorer(cfg, device), items, tokenizer.pad_token_id, topology.dp_size(Role.REWARD),
                           topology.dp_rank(Role.REWARD), topology.group(Role.REWARD))
    prompts_per_call = -(-min(cfg.chunk_size, len(items)) // topology.num_engines)
    engine = build_engine(cfg, topology.rollout_tp, device, tokenizer, prompts_per_call * cfg.generation.best_of_n)
    return ChunkGenerator(engine, items, sampling_spec(cfg), cfg.seed, tokenizer,
                          skip_special_tokens=cfg.eval_task == "generate", num_engines=topology.num_engines,
                          engine_index=topology.engine_index, engine_lead=topology.engine_rank == 0,
                          group=topology.group(Role.ROLLOUT))


def finish(cfg: BatchInferenceConfig, writer: ChunkedJsonlWriter) -> None:
    """Global rank 0, after the last chunk: reward statistics, the post-processed --output_path (written
    atomically), and the record that the run is complete."""
    rows = writer.rows()
    out, s = cfg.data.output_path, cfg.scoring
    if cfg.eval_task == "rm":
        mean, std = reward_stats(rows)
        print(f"reward mean {mean:.4f}, std {std:.4f} over {len(rows)} rows", flush=True)
        if s.processor:
            rows = post_process(s.processor, rows, s.reward_template, s.normalize_reward)
            write_atomically(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            print(f"--post_processor {s.processor}: {len(rows)} rows (scored rows kept in {writer.path})", flush=True)
    writer.mark_complete()
    print(f"wrote {len(rows)} rows to {out}", flush=True)


class InferenceRun(RunParts):
    """The core run's start for batch inference (checks, inputs, the output file, the rank plan); the chunks
    follow in `run`."""

    def prepare(self, cfg: BatchInferenceConfig, launch: LaunchEnv) -> dict[Role, tuple[int, ...]]:
        self.demo_line = _demo_line(cfg)
        self.tp_size = check_before_engines(cfg, launch.world_size)
        self.tokenizer = load_tokenizer(cfg.model.pretrain, cfg.model.trust_remote_code,
                                        use_fast=not cfg.model.disable_fast_tokenizer)
        self.role = Role.REWARD if cfg.eval_task == "rm" else Role.ROLLOUT
        self.items = (load_scoring_samples(cfg, self.tokenizer) if self.role is Role.REWARD
                      else load_generation_prompts(cfg, self.tokenizer))
        self.writer, self.complete = (open_output(cfg, len(self.items), self.tp_size) if launch.rank == 0
                                      else (None, False))
        return plan_ranks(Placement({self.role: 0}), launch.world_size)

    def topology(self, cfg: BatchInferenceConfig, plan: dict[Role, tuple[int, ...]]) -> Topology:
        return Topology(plan, rollout_tp=self.tp_size)


def run(cfg: BatchInferenceConfig, parse_warnings: Sequence[warnings.WarningMessage] = ()) -> None:
    """Generate or score on every rank; global rank 0 writes."""
    log_dir = os.path.dirname(os.path.abspath(cfg.data.output_path))
    parts = InferenceRun()
    started = start(parts, cfg, parse_warnings, logging=LoggingConfig(save_path=log_dir, verbose=cfg.verbose),
                    trains=False)
    cfg, topology, is_writer = started.cfg, started.topology, started.is_writer
    group = topology.group(parts.role)
    agreed = [parts.complete]
    dist.broadcast_object_list(agreed, src=0, group=group)
    if agreed[0]:
        if is_writer:
            print(f"{cfg.data.output_path} is complete ({progress_path(cfg.data.output_path)}): nothing to do; delete "
                  "it to write it again", flush=True)
        finish_distributed()
        return
    if is_writer:
        if started.demo:
            print(parts.demo_line, flush=True)
        print(_describe(cfg, len(parts.items), topology), flush=True)
    compute = _chunk_fn(cfg, parts.items, topology, started.device, parts.tokenizer)
    seed_everything(cfg.seed + started.launch.rank, cfg.full_determinism)  # vLLM re-seeds globally (samples: own seeds)
    finished = process(cfg, len(parts.items), parts.writer, compute, started.preemption, group)
    dist.barrier(group=group)
    finish_distributed()
    if not finished:
        raise SystemExit(PREEMPTED_EXIT_CODE)


def process(cfg: BatchInferenceConfig, num_items: int, writer: ChunkedJsonlWriter | None,
            compute: Callable[[range], list[dict]], preemption: PreemptionWatch, group: dist.ProcessGroup) -> bool:
    """Every chunk not yet written, with a progress bar on rank 0 (`writer`'s rank); then `finish`, or the line
    saying where a signal stopped the run. Returns whether every chunk is done. Every rank of `group` calls it."""
    scoring = cfg.eval_task == "rm"
    bar = None
    if writer is not None:
        from tqdm import tqdm

        bar = tqdm(total=num_items, initial=min(writer.progress.chunks_done * cfg.chunk_size, num_items),
                   desc="scoring" if scoring else "generating", unit="row" if scoring else "prompt",
                   dynamic_ncols=True)

    def chunk(items: range) -> list[dict]:
        with watchdog.stage("score" if scoring else "generate"):  # a stage per chunk: the watchdog sees progress
            return compute(items)

    finished = run_chunks(writer, num_items, cfg.chunk_size, chunk, preemption.should_stop, group,
                          on_chunk=lambda done: bar.update(done - bar.n) if bar is not None else None)
    if writer is None:
        return finished
    bar.close()
    if finished:
        finish(cfg, writer)
    else:
        p = writer.progress
        print(f"stopped by a signal after {p.chunks_done} of {p.num_chunks} chunks ({p.num_rows} rows in "
              f"{writer.path}): rerun the same command to continue", flush=True)
    return finished
