"""One step of process-reward-model training (`train_prm`): the causal LM's logits at each placeholder token
(one after each step of an answer) over the reward tokens, cross-entropy against the step's label (hard or
soft), summed over placeholders and divided by the placeholder count of the whole global batch. Evaluation
gives held-out loss and step accuracy.

A `rlhf.core.loop.Job`; knows the model wrapper, the sampler and the PRM record, not launchers or flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.reward_model import IGNORE_INDEX, prm_token_losses_N
from rlhf.core.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.core.metrics import Reduce
from rlhf.data.supervised_samples import PRMBatch
from rlhf.trainers.supervised_trainer import MODEL, SupervisedTrainer

PRM_METRICS = {**dict.fromkeys(("prm_loss", "acc", "aux_loss"), Reduce.SHARE),
               **dict.fromkeys(("grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


def placeholder_logits(model: torch.nn.Module, batch: PRMBatch, layout, device: torch.device,
                       reward_token_ids: list[int] | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logits_NR, labels_N, aux_loss) at the labelled placeholders of `batch`: the logits over the reward tokens
    (every token without them), float32 as the model gives them, the labels (int64 indices or float
    probabilities), and the model's MoE router loss (None unless it returns one)."""
    laid = layout.lay_out(batch.input_ids_BT.to(device), batch.attention_mask_BT.to(device))
    out = model(**laid.kwargs)
    logits = out.logits
    if reward_token_ids is not None:
        logits = logits.index_select(-1, torch.tensor(reward_token_ids, device=logits.device))
    padded = laid.to_padded(logits)
    mask = batch.label_mask_BT.to(device)
    return padded[mask], batch.labels_BT.to(device)[mask], getattr(out, "aux_loss", None)


class ProcessRewardTrainer(SupervisedTrainer):
    """PRM training on the ranks of `MODEL` (every rank)."""

    batch_type = PRMBatch
    metrics = PRM_METRICS
    eval_sums = (3,)

    def __init__(self, *args, reward_token_ids: list[int] | None, aux_loss_coef: float = 0.0) -> None:
        super().__init__(*args)
        self.reward_token_ids = reward_token_ids
        self.aux_loss_coef = aux_loss_coef
        # the logits arrive already restricted to the reward tokens: their classes are 0..R-1
        self.classes = list(range(len(reward_token_ids))) if reward_token_ids is not None else None

    def _losses(self, batch: PRMBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        logits, labels, aux_loss = placeholder_logits(self.model.engine, batch, self.batcher.layout, self.device,
                                                      self.reward_token_ids)
        return (*prm_token_losses_N(logits, labels, self.classes), aux_loss)

    def step(self, step: int) -> dict[str, float]:
        with self.timer.stage("train"):
            micro_batches = self.next_micro_batches(step)
            (num_positions,) = global_counts([sum(float((m.label_mask_BT & (m.labels_BT != IGNORE_INDEX)).sum())
                                                  for m in micro_batches)], self.group, self.batcher.layout.ring_size)

            num_micro = len(micro_batches) * dist.get_world_size(self.group)  # the aux loss: a mean over them
            num_replica_micro = len(micro_batches) * self.topology.dp_size(MODEL)  # its logged mean

            def micro_loss(batch: PRMBatch) -> MicroLoss:
                loss_N, _, correct_N, aux_loss = self._losses(batch)
                loss = loss_N.sum() / num_positions
                terms = {"prm_loss": loss, "acc": correct_N.float().sum() / num_positions}
                if aux_loss is not None and self.aux_loss_coef:  # OpenRLHF: prm_loss + coef * aux_loss
                    terms["aux_loss"] = aux_loss / num_replica_micro
                    loss = loss + self.aux_loss_coef * aux_loss / num_micro
                return MicroLoss(loss, terms)

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
        return self.reduced(stats)

    def eval_scores(self, items: list):
        """Loss sum, correct and labelled placeholders of each micro-batch."""
        for batch in items:
            loss_N, counted_N, correct_N, _ = self._losses(batch)
            yield loss_N.sum(), correct_N.sum(), counted_N.sum()

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """Held-out loss and accuracy per labelled placeholder."""
        loss, correct, counted = totals
        return {"eval_prm_loss": loss / max(counted, 1.0), "eval_acc": correct / max(counted, 1.0)}
