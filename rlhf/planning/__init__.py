"""Memory and placement plans made before a run starts: model shapes read from config files (no weights), a
per-rank, per-stage estimate of peak memory, and the `--dry_run` report that says whether a job fits."""
