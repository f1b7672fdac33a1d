"""Each supervised and preference job's parts (its `SupervisedJob` and `run`), and the framework they share
(`rlhf.jobs.supervised_run`); `rlhf/cli/train_<job>.py` is its entry point."""
