"""Imported last by the ranks' forkserver and the launch server (`tests.distributed.PRELOAD`): once the libraries are
in, what each rank would otherwise do again at its start with them is done here once, as the product's launcher does
before it forks its workers (`rlhf.cli.warm_start.prepare_workers`)."""

from rlhf.cli.warm_start import prepare_workers
from tests.distributed import PRELOAD

prepare_workers(PRELOAD)
