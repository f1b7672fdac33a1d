"""Every job's one registration: its name (`python -m rlhf.cli.<name>`, console script `rlhf-<name>` with dashes),
its config root and the kind of memory plan `--dry_run` draws for it. The flag parser (which other job knows a
flag), the checkpoints' run identity and the planner (`rlhf.planning.job_memory`) read this table; setup.cfg's
console scripts and the entry points are checked against it (tests/unit/test_job_registry.py). Config roots are
named by "module:Class" and imported on use, so this module imports no job."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class JobEntry:
    name: str
    root: str  # "module:Class" of its config root
    memory: str  # the planner's reader: "ppo", "supervised" or "inference"
    fork: bool = False  # the RePULSe fork's train_ppo: its own flags are explained apart (`rlhf.config.flags`)

    @property
    def console_script(self) -> str:
        return f"rlhf-{self.name.replace('_', '-')}"

    @property
    def root_name(self) -> str:
        return self.root.split(":")[1]

    def root_class(self) -> type:
        module, name = self.root.split(":")
        return getattr(importlib.import_module(module), name)


_PREF = "rlhf.config.preference_config"
_SUP = "rlhf.config.supervised_config"
JOBS: tuple[JobEntry, ...] = (
    JobEntry("train_ppo", "rlhf.config.ppo_config:TrainPPOConfig", "ppo"),
    JobEntry("train_repulse", "rlhf.repulse.repulse_config:TrainRepulseConfig", "ppo", fork=True),
    JobEntry("train_sft", f"{_SUP}:TrainSFTConfig", "supervised"),
    JobEntry("train_rm", f"{_SUP}:TrainRMConfig", "supervised"),
    JobEntry("train_prm", f"{_SUP}:TrainPRMConfig", "supervised"),
    JobEntry("train_kd", f"{_SUP}:TrainKDConfig", "supervised"),
    JobEntry("train_dpo", f"{_PREF}:TrainDPOConfig", "supervised"),
    JobEntry("train_kto", f"{_PREF}:TrainKTOConfig", "supervised"),
    JobEntry("train_simpo", f"{_PREF}:TrainSimPOConfig", "supervised"),
    JobEntry("train_orpo", f"{_PREF}:TrainORPOConfig", "supervised"),
    JobEntry("train_cpo", f"{_PREF}:TrainCPOConfig", "supervised"),
    JobEntry("batch_inference", "rlhf.config.inference_config:BatchInferenceConfig", "inference"),
)


def job_of(cfg: object) -> JobEntry | None:
    """The registered job whose config root's class name is `cfg`'s (not a base class's: a subclass root is a job
    of its own); None when it is not registered."""
    return next((entry for entry in JOBS if entry.root_name == type(cfg).__name__), None)
