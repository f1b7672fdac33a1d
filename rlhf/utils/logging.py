"""Metrics sinks of rank 0: one JSON line per step in metrics.jsonl, TensorBoard, a progress bar."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field


@dataclass
class WandbSettings:
    """What `--use_wandb` and friends ask for; `start()` logs in and opens the run (rank 0 only)."""

    key: str
    project: str
    group: str | None = None
    run_name: str | None = None
    config: dict = field(default_factory=dict)

    def start(self):
        try:
            import wandb
        except ImportError as err:
            raise ValueError("--use_wandb needs the wandb package: pip install wandb") from err
        if self.key.lower() != "true":
            wandb.login(key=self.key)
        return wandb.init(project=self.project, group=self.group, name=self.run_name, config=self.config)


class MetricsLogger:
    """Writes metrics on the writer rank only; other ranks hold a no-op logger."""

    def __init__(self, out_dir: str, tensorboard_dir: str | None, total_steps: int, enabled: bool,
                 wandb: WandbSettings | None = None) -> None:
        self.enabled = enabled
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

        self.bar = tqdm(total=total_steps, desc="rl steps", dynamic_ncols=True)

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
            self.bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                                 step_s=f"{metrics.get('time/step', float('nan')):.2f}")
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
