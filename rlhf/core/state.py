"""What a job's checkpoint holds, registered by name, so that exact resume works for any job without the
checkpoint code knowing the job: trainable engines (DeepSpeed states, one directory each), small stateful
components (samplers, controllers, running statistics; pickled into the trainer state), and an optional HF
export of the trained model. Every rank's RNG state is saved by the checkpointer itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rlhf.engines.deepspeed_engine import DeepSpeedModel


class Stateful(Protocol):
    """A component whose position or statistics a resumed run needs."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class CheckpointedState:
    """A job's checkpointed parts, by name. Build it on every rank with the same names.

    `engines`: trainable models (None on ranks that do not host one); each is saved and loaded collectively
    over its own DP group. `components`: small states, taken from rank 0 (which must host them; ranks that
    host one must agree on its state, as a data sampler or a controller driven by global values does); None
    where this rank does not host it. `hf_export(directory)`: writes the trained model in HF format
    (--save_hf_ckpt); collective over the world. `next_samples(steps_done)`: the data ids (places in the training
    data) of the step after `steps_done`, named on resume.
    """

    engines: dict[str, DeepSpeedModel | None] = field(default_factory=dict)
    components: dict[str, Stateful | None] = field(default_factory=dict)
    hf_export: Callable[[str], None] | None = None
    next_samples: Callable[[int], list[int]] | None = None
