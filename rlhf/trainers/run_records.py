"""What an RL run keeps besides its models: the count of responses sampled so far (the sample budget the
fork's curves are drawn against), `--save_negdata`'s low-reward responses and `--save_info_path`'s
evaluation rows. Checkpointed, so a resumed run neither loses nor repeats rows.
"""

from __future__ import annotations

import json
import os

import torch

from rlhf.data.records import Rollout


class JsonlAppender:
    """Rows appended to a JSON Lines file by rank 0, with the count written kept in checkpoints: a resumed run
    cuts the file back to the checkpoint's rows before appending (no duplicates from the lost attempt)."""

    def __init__(self, path: str | None, is_writer: bool) -> None:
        self.path, self.is_writer, self.count = path, is_writer and path is not None, 0

    def append(self, rows: list[dict]) -> None:
        if self.is_writer and rows:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        self.count += len(rows)

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
        if self.is_writer and os.path.exists(self.path):
            with open(self.path) as f:
                kept = f.readlines()[:self.count]
            with open(self.path, "w") as f:
                f.writelines(kept)


class RunRecords:
    """The sample counter and the two row files of a run (identical on every rank; rank 0 writes)."""

    def __init__(self, is_writer: bool, negdata_path: str | None = None, negdata_threshold: float | None = None,
                 info_path: str | None = None) -> None:
        """`negdata_path`: where responses with a raw reward below `negdata_threshold` go; `info_path`: where
        each evaluation's row goes (None: not written)."""
        self.samples_drawn = 0
        self.negdata_threshold = negdata_threshold if negdata_path else None
        self.negdata = JsonlAppender(negdata_path, is_writer)
        self.info = JsonlAppender(info_path, is_writer)

    def keep_negatives(self, batch: Rollout, rewards_B: torch.Tensor, source: str, step: int) -> None:
        """--save_negdata: the responses of `batch` whose raw reward is below --save_negdata_threshold."""
        if self.negdata_threshold is None:
            return
        low = (rewards_B < self.negdata_threshold).nonzero().flatten().tolist()
        self.negdata.append([{"step": step + 1, "source": source, "prompt": batch.prompts[i],
                              "response": batch.responses[i], "reward": float(rewards_B[i])} for i in low])

    def state_dict(self) -> dict:
        return {"samples_drawn": self.samples_drawn, "negdata": self.negdata.state_dict(),
                "info": self.info.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.samples_drawn = int(state["samples_drawn"])
        self.negdata.load_state_dict(state["negdata"])
        self.info.load_state_dict(state["info"])
