"""One step of process-reward-model training (`train_prm`): the causal LM's logits at each placeholder token
(one after each step of an answer) over the reward tokens, cross-entropy against the step's label (hard or
soft), summed over placeholders and divided by the placeholder count of the whole global batch. Evaluation
gives held-out loss and step accuracy.

A `rlhf.train.loop.Job`; knows the model wrapper, the sampler and the PRM record, not launchers or flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.reward_model import IGNORE_INDEX, prm_token_losses_N
from rlhf.data.sampler import DistributedBatchSampler
from rlhf.data.supervised import PRMBatch, PRMSample
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.micro_batches import MicroBatcher
from rlhf.train.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.train.metrics import Reduce, reduce_metrics
from rlhf.train.state import CheckpointedState
from rlhf.utils.timers import StageTimer

PRM_METRICS = {**dict.fromkeys(("prm_loss", "acc"), Reduce.SHARE),
               **dict.fromkeys(("grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


def placeholder_logits(model: torch.nn.Module, batch: PRMBatch, layout, device: torch.device,
                       reward_token_ids: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_NR, labels_N) at the labelled placeholders of `batch`: the logits over the reward tokens (every
    token without them), float32 as the model gives them, and the labels (int64 indices or float probabilities)."""
    laid = layout.lay_out(batch.input_ids_BT.to(device), batch.attention_mask_BT.to(device))
    logits = model(**laid.kwargs).logits
    if reward_token_ids is not None:
        logits = logits.index_select(-1, torch.tensor(reward_token_ids, device=logits.device))
    padded = laid.to_padded(logits)
    mask = batch.label_mask_BT.to(device)
    return padded[mask], batch.labels_BT.to(device)[mask]


class ProcessRewardTrainer:
    """PRM training on the ranks of `Role.ACTOR` (every rank)."""

    def __init__(self, model: DeepSpeedModel, topology: Topology, samples: list[PRMSample],
                 eval_samples: list[PRMSample], sampler: DistributedBatchSampler, batcher: MicroBatcher,
                 tokenizer, device: torch.device, reward_token_ids: list[int] | None) -> None:
        self.model, self.topology, self.samples, self.eval_samples = model, topology, samples, eval_samples
        self.sampler, self.batcher, self.tokenizer, self.device = sampler, batcher, tokenizer, device
        self.reward_token_ids = reward_token_ids
        # the logits arrive already restricted to the reward tokens: their classes are 0..R-1
        self.classes = list(range(len(reward_token_ids))) if reward_token_ids is not None else None
        self.group = topology.group(Role.ACTOR)
        self.timer = StageTimer()

    def _batches(self, samples: list[PRMSample]) -> list[PRMBatch]:
        batch = PRMBatch.collate(samples, self.tokenizer.pad_token_id)
        return [batch.select(torch.tensor(rows)).trimmed() for rows in self.batcher.split(batch.attention_mask_BT)]

    def _losses(self, batch: PRMBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, labels = placeholder_logits(self.model.engine, batch, self.batcher.layout, self.device,
                                            self.reward_token_ids)
        return prm_token_losses_N(logits, labels, self.classes)

    def step(self, step: int) -> dict[str, float]:
        assert self.sampler.step == step, f"sampler at step {self.sampler.step}, loop at {step}"
        with self.timer.stage("train"):
            micro_batches = self._batches([self.samples[i] for i in self.sampler.next()])
            (num_positions,) = global_counts([sum(float((m.label_mask_BT & (m.labels_BT != IGNORE_INDEX)).sum())
                                                  for m in micro_batches)], self.group, self.batcher.layout.ring_size)

            def micro_loss(batch: PRMBatch) -> MicroLoss:
                loss_N, _, correct_N = self._losses(batch)
                loss = loss_N.sum() / num_positions
                return MicroLoss(loss, {"prm_loss": loss, "acc": correct_N.float().sum() / num_positions})

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
        return reduce_metrics({Role.ACTOR: stats}, PRM_METRICS, self.topology)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss and accuracy per labelled placeholder. Collective over the world."""
        if not self.eval_samples:
            return {}
        self.model.eval()
        dp, rank = self.topology.dp_size(Role.ACTOR), self.topology.dp_rank(Role.ACTOR)
        mine = [self.eval_samples[i] for i in range(rank, len(self.eval_samples), dp)]
        sums = torch.zeros(3, dtype=torch.float64)  # loss, correct, counted
        for batch in self._batches(mine) if mine else []:
            loss_N, counted_N, correct_N = self._losses(batch)
            sums += torch.tensor([float(loss_N.sum()), float(correct_N.sum()), float(counted_N.sum())],
                                 dtype=torch.float64)
        if self.topology.ring_rank(Role.ACTOR) != 0:  # the ranks of a ring score the same samples
            sums.zero_()
        dist.all_reduce(sums)
        loss, correct, counted = sums.tolist()
        return {"eval_prm_loss": loss / max(counted, 1.0), "eval_acc": correct / max(counted, 1.0)}

    def checkpointed(self) -> CheckpointedState:
        def hf(directory: str) -> None:
            self.model.save_hf(directory, self.tokenizer, self.topology.leads(Role.ACTOR))

        return CheckpointedState(engines={"model": self.model}, components={"sampler": self.sampler}, hf_export=hf)
