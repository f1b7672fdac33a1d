"""--async_train: PPO whose generation runs on ranks of their own, a step (or --async_queue_size steps) ahead
of the ranks that train. The step differs from `PPOTrainer.step`; experience, training and weight pushes are
PPO's own."""

from __future__ import annotations

import collections

from rlhf.data.records import Rollout
from rlhf.distributed.collectives import all_gather_rollout, broadcast_rollout
from rlhf.distributed.topology import Role
from rlhf.trainers.ppo_trainer import PPOTrainer


class AsyncPPOTrainer(PPOTrainer):
    """PPO with a queue of batches generated ahead of training."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._queue: collections.deque[Rollout] = collections.deque()  # batches ahead of training
        self._next_generated: int | None = None  # the step whose batch is generated next

    def step(self, step: int) -> dict[str, float]:
        """--async_train: the generation ranks sample the batch of step + --async_queue_size with the weights their
        engines hold while the training ranks make experience from the oldest queued batch (this step's) and
        train on it. At the end of the step the new batch joins the queue and the new weights reach the
        generation ranks, so a batch is trained on up to --async_queue_size updates after its weights (the
        correction: --enable_vllm_is_correction). A started or resumed run first fills the queue with batches of
        the current weights. Collective over the world."""
        self.steps_done = step + 1
        ahead, last = self.cfg.rollout.async_queue_size, self.total_steps
        if self._next_generated is None:
            self._next_generated = step
        while self._next_generated < min(step + ahead, last):  # filling the queue: nothing to overlap with yet
            with self.timer.stage("generation"):
                self._enqueue(self.generate(self._next_generated) if self.topology.generates else None)
        overlapped = step + ahead < last
        metrics: dict[str, float] = {}
        if self.topology.generates:  # the engine samples ahead while the other ranks train
            with self.timer.stage("generation"):
                local = self.generate(step + ahead) if overlapped else None
            metrics.update(self.train(None, step, False))  # the training ranks' metric reduction (world)
        else:
            batch = self._queue.popleft()
            with self.timer.stage("experience"):
                experience, metrics = self._experience(batch)
            self.records.samples_drawn += batch.num_samples
            with self.timer.stage("train"):
                metrics.update(self._train_stage(experience, step, step >= self.cfg.algo.freezing_actor_steps))
            local = None
        with self.timer.stage("wait_rollout"):  # training ranks: how long the generation ranks kept them waiting
            if overlapped:
                self._enqueue(local)
        with self.timer.stage("weight_sync"):
            if step >= self.cfg.algo.freezing_actor_steps:
                self.sync_weights()
        metrics["async_queue"] = float(len(self._queue)) if not self.topology.generates else 0.0
        return metrics

    def _enqueue(self, local: Rollout | None) -> None:
        """The generation ranks' new batch (their `local` shares; None elsewhere) joins the queue of every training
        rank. Collective over the world."""
        rollout_group = self.topology.group(Role.ROLLOUT) if self.topology.generates else None
        gathered = all_gather_rollout(local, self.tokenizer.pad_token_id, rollout_group) if local is not None else None
        batch = broadcast_rollout(gathered, src=self.topology.ranks(Role.ROLLOUT)[0])
        self._next_generated += 1
        if not self.topology.generates:
            self._queue.append(batch)
