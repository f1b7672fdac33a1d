"""What the supervised steps (SFT, reward model, process reward model, distillation) share: this rank's
micro-batches of the sampler's next global batch, its share of the held-out samples, the held-out evaluation
loop with its sums over the world, the declared metric reduction and the checkpointed state (model, sampler, HF
export). A subclass supplies the batch record, the metric table, `step`, and for the evaluation how one
micro-batch is scored (`eval_scores`) and what the world's sums mean (`eval_metrics`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist

from rlhf.core.metrics import Reduce, reduce_metrics
from rlhf.core.state import CheckpointedState
from rlhf.data.sampler import DistributedBatchSampler
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.micro_batches import MicroBatcher
from rlhf.utils.timers import StageTimer

MODEL = Role.define("model")
"""The model a supervised or preference job trains (the SFT policy, the reward model, the DPO policy, the KD
student): its ranks are every rank but those of a frozen model placed on ranks of its own."""


class SupervisedTrainer:
    """The trained model on the ranks of `MODEL`. Construct on those ranks with the same samples."""

    batch_type: ClassVar[type]  # the record with `collate(samples, pad_id)`, `select` and `trimmed`
    metrics: ClassVar[dict[str, Reduce]]
    eval_sums: ClassVar[tuple[int, ...]]
    """The lengths of the float64 sums `evaluate` all-reduces over the world, in order. A frozen role on ranks of
    its own (`rlhf.trainers.frozen.FrozenService`) takes part in the same collectives from this declaration, so
    `evaluate` checks that it holds."""

    def __init__(self, model: DeepSpeedModel, topology: Topology, samples: list, eval_samples: list,
                 sampler: DistributedBatchSampler, batcher: MicroBatcher, tokenizer, device: torch.device) -> None:
        self.model, self.topology, self.samples, self.eval_samples = model, topology, samples, eval_samples
        self.sampler, self.batcher, self.tokenizer, self.device = sampler, batcher, tokenizer, device
        self.group = topology.data_group(MODEL)  # one rank of each replica: its sums count each sample once
        self.timer = StageTimer()
        self._world_sums: list[int] = []  # the lengths `world_sums` added during this evaluation

    def cost_mask(self, batch) -> torch.Tensor:
        """[B, T'] 1 on the tokens a sample costs (what dynamic batching budgets)."""
        return batch.attention_mask_BT

    def micro_batches(self, samples: list, batcher: MicroBatcher | None = None, batch_type: type | None = None
                      ) -> list:
        batch = (batch_type or self.batch_type).collate(samples, self.tokenizer.pad_token_id)
        splits = (batcher or self.batcher).split(self.cost_mask(batch))
        return [batch.select(torch.tensor(rows)).trimmed() for rows in splits]

    def next_micro_batches(self, step: int) -> list:
        """This rank's micro-batches of global batch `step` (the sampler's position must be `step`)."""
        assert self.sampler.step == step, f"sampler at step {self.sampler.step}, loop at {step}"
        return self.micro_batches([self.samples[i] for i in self.sampler.next()])

    def eval_micro_batches(self, samples: list | None = None, batch_type: type | None = None,
                           fallback: list | None = None) -> tuple[list, int]:
        """(micro-batches, how many of them count): this replica's share of the held-out samples (or of
        `samples`, already this replica's), in fixed-size micro-batches (no token budget: the shares may differ
        by a sample, and budgeting would make the ranks' micro-batch counts a collective), then copies of one of
        them (or of `fallback`, a sample list, for a replica with none) until every replica has as many as the
        most (at ZeRO-3 each forward gathers the parameters over the
        group, so every rank must run the same number). Score the copies and drop their results.
        Collective over the model's group."""
        if samples is None:
            dp, rank = self.topology.dp_size(MODEL), self.topology.dp_rank(MODEL)
            samples = [self.eval_samples[i] for i in range(rank, len(self.eval_samples), dp)]
        fixed = dataclasses.replace(self.batcher, max_tokens=None)
        batches = self.micro_batches(samples, fixed, batch_type) if samples else []
        most = torch.tensor([len(batches)], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        filler = batches[-1] if batches else self.micro_batches(fallback or self.eval_samples[:1], fixed, batch_type)[0]
        return batches + [filler] * (int(most) - len(batches)), len(batches)

    def eval_batches(self) -> tuple[list, int]:
        """(items, how many of them count) for `eval_scores`: this replica's held-out micro-batches padded to the
        most any replica has (`eval_micro_batches`); a job whose scoring needs more per micro-batch (a frozen
        model's log-probs) pairs them here."""
        return self.eval_micro_batches()

    def eval_scores(self, items: list) -> Iterator[Sequence[float | torch.Tensor]]:
        """One tuple of sums per item, in order, for every item (at ZeRO-3 each forward is a collective, so
        the padding items run too; the loop drops their sums)."""
        raise NotImplementedError

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """The held-out metrics from `eval_scores`' sums added over the data-parallel replicas."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation of every supervised and preference job: each replica scores its share,
        the sums of the items that count are added over the world, `eval_metrics` reads them. Collective over
        the world."""
        if not self.eval_samples:
            return {}
        self.model.eval()
        self._world_sums = []
        items, counted = self.eval_batches()
        totals: list[float] = []
        for i, scores in enumerate(self.eval_scores(items)):
            totals = totals or [0.0] * len(scores)
            if i < counted:
                totals = [total + float(v) for total, v in zip(totals, scores)]
        metrics = self.eval_metrics(self.world_sums(totals))
        if tuple(self._world_sums) != tuple(self.eval_sums):
            raise RuntimeError(f"{type(self).__name__}.evaluate added sums of lengths {tuple(self._world_sums)} over "
                               f"the world but declares eval_sums = {self.eval_sums}: a frozen role on ranks of its "
                               "own takes part in the declared collectives, so correct the declaration")
        return metrics

    def world_sums(self, sums: list[float]) -> list[float]:
        """`sums` added over the data-parallel replicas (the ranks of a ring hold the same samples: one counts).
        Collective over the world."""
        self._world_sums.append(len(sums))
        t = torch.tensor(sums if self.topology.replica_rank(MODEL) == 0 else [0.0] * len(sums),
                         dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def reduced(self, stats: dict[str, float]) -> dict[str, float]:
        return reduce_metrics({MODEL: stats}, self.metrics, self.topology)

    def save_hf(self, directory: str) -> None:
        """The trained model in HF format (collective over the model's ranks)."""
        self.model.save_hf(directory, self.tokenizer, self.topology.leads(MODEL))

    def checkpointed(self) -> CheckpointedState:
        return CheckpointedState(engines={"model": self.model}, components={"sampler": self.sampler},
                                 hf_export=self.save_hf, next_samples=self.sampler.global_batch)
