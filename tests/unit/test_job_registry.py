"""Every job is registered everywhere a job is listed: its config root in `rlhf.config.flags.JOB_CONFIGS`, an entry
point `rlhf/cli/<job>.py` with `main`, a console script `rlhf-<job>` in setup.cfg, and a memory reader in
`rlhf.planning.job_memory.READERS` (a root without one is refused, not planned as another job)."""

import configparser
import importlib
import os

import pytest

from rlhf.config.errors import UsageError
from rlhf.config.flags import JOB_CONFIGS
from rlhf.planning import job_memory
from tests.distributed import ROOT

JOBS = {**JOB_CONFIGS, "train_repulse": ("rlhf.repulse.repulse_config", "TrainRepulseConfig")}


def console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = [line.strip() for line in cfg["options.entry_points"]["console_scripts"].splitlines() if line.strip()]
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines)


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_job_is_fully_registered(job):
    module, root = JOBS[job]
    cls = getattr(importlib.import_module(module), root)
    assert callable(importlib.import_module(f"rlhf.cli.{job}").main)
    assert console_scripts().get(f"rlhf-{job.replace('_', '-')}") == f"rlhf.cli.{job}:main"
    assert any(issubclass(cls, reader_root) for reader_root, _ in job_memory.READERS), f"{root} has no memory reader"


def test_a_half_registered_job_is_refused_by_the_planner(monkeypatch):
    """A root that no reader takes fails with its name, instead of being planned as a supervised job."""

    class NewJobConfig:
        gpu_memory_gb = 80

    monkeypatch.setattr(job_memory, "READERS", [r for r in job_memory.READERS if r[0].__name__ != "TrainSFTConfig"])
    with pytest.raises(UsageError, match="no memory plan for NewJobConfig"):
        job_memory.job_memory(NewJobConfig(), {})
    from rlhf.config.supervised_config import TrainSFTConfig

    assert not any(issubclass(TrainSFTConfig, root) for root, _ in job_memory.READERS)  # what the test above catches
