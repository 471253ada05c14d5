"""Loss scaling for fp16 across every rank of a plan: :class:`GradScaler`.

``torch.amp.GradScaler`` looks for inf/NaN in the gradients this process holds. When a
plan shards parameters, one rank's shard can overflow where another's does not: that
rank skips the training step and lowers its scale while the other applies the step,
and the replicas drift apart with no error. hapd's scaler sums every rank's "found an
inf" flag over the job's process group before the optimizer step is taken or skipped,
so every rank skips the same training steps and keeps the same scale: sharded,
replicated and pipelined parameters alike (FSDP ships ``ShardedGradScaler`` for the same
reason; this one works on any plan, CPU or GPU, and a rank that holds no gradient at all
still takes part).

Its methods are ``torch.amp.GradScaler``'s (``scale``, ``unscale_``, ``step``,
``update``, ``state_dict``, ``load_state_dict``); :func:`hapd.save_checkpoint` saves its
state with the optimizer's (``scaler=``) and :func:`hapd.load_checkpoint` restores it on
any world size: the scale and its growth tracker are the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check is global over ``group`` (default:
    the job's whole process group; one process: torch's own behaviour).

    ``device`` defaults to the device of the job's ranks (``"cuda"`` when CUDA is
    available, else ``"cpu"``); the other arguments are ``torch.amp.GradScaler``'s.
    """

    def __init__(self, device: str | None = None, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 group: dist.ProcessGroup | None = None) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then agree with every rank on whether any
        gradient of the model (on any rank) holds an inf or NaN."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {self._scale.device: self._global_found_inf(state["found_inf_per_device"])}

    def _global_found_inf(self, found: dict[torch.device, torch.Tensor]) -> torch.Tensor:
        """One flag for every rank: the sum over ranks of this rank's flags (non-zero
        when any rank found an inf/NaN). Every rank all-reduces exactly one tensor, so a
        rank holding no gradient still meets the others' collective."""
        assert self._scale is not None
        total = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in found.values():
            total += flag.to(self._scale.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the training step of ``optimizer`` is skipped: an inf/NaN on any rank
        (after :meth:`unscale_` or :meth:`step`, before :meth:`update`)."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            raise RuntimeError("found_inf() before unscale_() or step() of this optimizer")
        return bool(sum(float(v.item()) for v in state["found_inf_per_device"].values()))
