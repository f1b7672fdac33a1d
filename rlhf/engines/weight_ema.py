"""An exponential moving average of a trainable model's weights (train_ppo --enable_ema, OpenRLHF's
`moving_average`): after each applied optimizer step, ema = beta x ema + (1 - beta) x weight, for every trainable
parameter, starting from the initial weights.

Each rank averages only what it stores: under ZeRO-3 its partition of each parameter (`ds_tensor`), below it
the whole parameter. The averages are float32 on the host (OpenRLHF keeps them in the parameter dtype, where a
step of (1 - beta) x difference mostly rounds away in bf16). Knows DeepSpeed's ZeRO-3 partition layout (a
parameter flattened, padded and cut into equal consecutive pieces over the data-parallel group), not the model
wrapper that owns the parameters or any job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ema_update_(ema: torch.Tensor, value: torch.Tensor, beta: float) -> None:
    """ema <- beta x ema + (1 - beta) x value, in place (value cast to ema's dtype and device)."""
    ema.mul_(beta).add_(value.detach().to(ema.device, ema.dtype), alpha=1.0 - beta)


class WeightEMA:
    """The moving average of `params` (name -> trainable parameter, the same names and order on every rank of
    `group`). `zero3`: the parameters are ZeRO-3 partitioned over `group`, and each rank averages its partition."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], beta: float, *, zero3: bool,
                 group: dist.ProcessGroup | None) -> None:
        assert 0.0 <= beta <= 1.0, beta
        self.params, self.beta, self.zero3, self.group = params, beta, zero3, group
        self.averages = {name: self._local(p).detach().to("cpu", torch.float32, copy=True) for name, p in params}

    def _local(self, param: torch.nn.Parameter) -> torch.Tensor:
        return param.ds_tensor if self.zero3 else param.data

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in (call after each applied optimizer step; no collective)."""
        for name, param in self.params:
            ema_update_(self.averages[name], self._local(param), self.beta)

    def full(self, name: str, param: torch.nn.Parameter) -> torch.Tensor:
        """The whole average of parameter `name` (float32, the parameter's shape). Under ZeRO-3 the partitions
        are gathered over `group`: collective, every rank calls it for the same parameters in the same order."""
        local = self.averages[name]
        if not self.zero3:
            return local
        local = local.to(param.ds_tensor.device)  # NCCL gathers device tensors
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group=self.group))]
        dist.all_gather(pieces, local, group=self.group)
        return torch.cat(pieces)[:param.ds_numel].view(param.ds_shape).cpu()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's averages (its partitions under ZeRO-3)."""
        return dict(self.averages)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state.keys() != self.averages.keys() or any(state[n].shape != a.shape for n, a in self.averages.items()):
            raise ValueError("the saved weight averages are of another model or another rank layout")
        self.averages = {name: tensor.to(torch.float32) for name, tensor in state.items()}
