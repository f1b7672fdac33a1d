"""Every job has one registration (`rlhf.config.jobs.JOBS`: name, config root, memory kind) and the rest follows
or is checked against it: the entry point `rlhf/cli/<job>.py` parses that root, setup.cfg has the console script
`rlhf-<job>`, the planner has a reader of its kind, the flag parser's job table and the checkpoints' job name come
from it; a root that is not registered is refused by the planner, never planned as some other job."""

import configparser
import importlib
import os

import pytest

from rlhf.config.errors import UsageError
from rlhf.config.flags import JOB_CONFIGS
from rlhf.config.jobs import JOBS, job_of
from rlhf.planning import job_memory
from tests.distributed import ROOT


def console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = [line.strip() for line in cfg["options.entry_points"]["console_scripts"].splitlines() if line.strip()]
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines)


@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.name)
def test_every_job_is_fully_registered(job, monkeypatch):
    cls = job.root_class()
    module = importlib.import_module(f"rlhf.cli.{job.name}")
    parsed = []
    monkeypatch.setattr(module, "main_for", lambda root, *a, **k: parsed.append(root))
    module.main([])
    assert parsed == [cls], f"rlhf.cli.{job.name} parses {parsed}, not its registered root {job.root}"
    assert console_scripts().get(job.console_script) == f"rlhf.cli.{job.name}:main"
    assert job.memory in job_memory.READERS, f"{job.name}: no memory reader of kind {job.memory!r}"
    assert job_of(cls.__new__(cls)) is job
    assert (JOB_CONFIGS.get(job.name) == tuple(job.root.split(":"))) != job.fork


def test_the_registry_names_every_entry_point_and_console_script():
    """A job's entry point or console script that the registry lacks fails here (tools have no config root)."""
    tools = {"build_tiny", "build_zoo", "entry_point", "evaluate_gcg", "evaluate_gcg_sz", "exit_barrier", "launch",
             "lora_combiner", "plot", "plot_repulse", "serve_rm", "warm_start"}
    cli = {name[:-3] for name in os.listdir(os.path.join(ROOT, "rlhf", "cli")) if name.endswith(".py")} - {"__init__"}
    assert cli - tools == {job.name for job in JOBS}
    jobs = {script for script, target in console_scripts().items() if script.startswith("rlhf-train-")
            or target.startswith("rlhf.cli.batch_inference")}
    assert jobs == {job.console_script for job in JOBS}


def test_a_half_registered_job_is_refused_by_the_planner(monkeypatch):
    """A root the registry lacks, or whose kind has no reader, fails with its name instead of being planned as a
    supervised job (as a first-match reader table once did)."""
    from rlhf.config import jobs
    from rlhf.config.supervised_config import TrainSFTConfig

    class NewJobConfig(TrainSFTConfig):  # a new job built on SFT's root, not registered yet
        pass

    cfg = NewJobConfig.__new__(NewJobConfig)
    object.__setattr__(cfg, "gpu_memory_gb", 80)
    with pytest.raises(UsageError, match="no memory plan for NewJobConfig .not registered in rlhf.config.jobs.JOBS"):
        job_memory.job_memory(cfg, {})
    monkeypatch.setattr(jobs, "JOBS", (*jobs.JOBS, jobs.JobEntry("train_new", f"{__name__}:NewJobConfig", "new")))
    globals()["NewJobConfig"] = NewJobConfig
    with pytest.raises(UsageError, match="READERS has no reader of kind 'new'"):
        job_memory.job_memory(cfg, {})
