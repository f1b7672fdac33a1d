"""The job-agnostic core every trainer runs on: the loop, checkpointed state, metric reductions and the
optimizer step over micro-batches. Nothing here knows a job, a loss or a dataset."""
