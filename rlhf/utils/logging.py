"""Metrics sinks of rank 0: one JSON line per step in metrics.jsonl, TensorBoard, a progress bar."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from rlhf.config.errors import UsageError


@dataclass
class WandbSettings:
    """What `--use_wandb` and friends ask for; `start()` logs in and opens the run (rank 0 only)."""

    key: str
    project: str
    group: str | None = None
    run_name: str | None = None
    config: dict = field(default_factory=dict)
    entity: str | None = None  # --wandb_org: the team or user; None: the login's default entity

    def start(self):
        try:
            import wandb
        except ImportError as err:
            raise ValueError("--use_wandb needs the wandb package: pip install wandb") from err
        if self.key.lower() != "true":
            wandb.login(key=self.key)
        return wandb.init(entity=self.entity, project=self.project, group=self.group, name=self.run_name,
                          config=self.config)


def check_no_earlier_run(out_dir: str) -> None:
    """UsageError when `out_dir` already holds another run's metrics (a fresh run would mix its rows
    into them and overwrite that run's model). Any rank may call it; no collective."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = sum(1 for line in f if line.strip())
    if rows:
        raise UsageError(f"{path} already holds {rows} rows of metrics from an earlier run: pass --load_checkpoint "
                         "to continue that run, or choose another --save_path")


class MetricsLogger:
    """Writes metrics on the writer rank only; other ranks hold a no-op logger."""

    def __init__(self, out_dir: str, tensorboard_dir: str | None, total_steps: int, enabled: bool,
                 wandb: WandbSettings | None = None, bar_desc: str = "rl steps",
                 bar_metrics: dict[str, str] | None = None) -> None:
        """`bar_metrics`: progress-bar label -> metric shown after each step (default: the RL reward)."""
        self.enabled = enabled
        self.bar_metrics = bar_metrics if bar_metrics is not None else {"reward": "reward_mean"}
        self.writer = None
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        if wandb is not None:
            self.wandb = wandb.start()
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, desc=bar_desc, dynamic_ncols=True)

    def continue_from(self, step: int, resuming: bool) -> str | None:
        """Line metrics.jsonl up with where training starts (writer rank; a no-op elsewhere). Resuming after
        `step` steps keeps the rows with step <= `step`: later rows (and a line cut by a crash) came from the
        attempt that was lost and would be logged twice. A run that is not resuming refuses a metrics.jsonl
        that already has rows, before anything is overwritten. Returns a line to print, or None."""
        if not self.enabled or not os.path.isfile(self.jsonl_path):
            return None
        with open(self.jsonl_path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        if not resuming:
            check_no_earlier_run(os.path.dirname(self.jsonl_path))
            return None
        kept = [line for line in lines if _row_step(line) is not None and _row_step(line) <= step]
        if len(kept) == len(lines):
            return None
        tmp = self.jsonl_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.jsonl_path)
        return (f"{self.jsonl_path}: dropped {len(lines) - len(kept)} rows logged after step {step} by the "
                "interrupted run (they are logged again)")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                   for k, v in metrics.items()}}
        with open(self.jsonl_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def advance(self, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            shown = {label: f"{metrics[key]:.3f}" if abs(metrics[key]) < 1000 else f"{metrics[key]:.0f}"
                     for label, key in self.bar_metrics.items() if key in metrics}
            self.bar.set_postfix(**shown, step_s=f"{metrics.get('time/step', float('nan')):.2f}")
            self.bar.update(1)

    def skip(self, steps: int) -> None:
        """Advance the progress bar past steps done before a resume."""
        if self.bar is not None and steps:
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _row_step(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line that does not parse (cut by a crash)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
