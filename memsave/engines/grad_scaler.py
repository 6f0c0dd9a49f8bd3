"""``torch.amp.GradScaler`` over an fp32 profile, whose gradients are split over the ranks.

[Note: one skip decision for GradScaler] GradScaler decides per rank: ``unscale_`` looks for infs in the
gradients the optimizer holds, and ``step`` skips ``optimizer.step()`` where it found one. Under ZeRO, tensor or
pipeline parallelism each rank holds other gradient elements, so an overflow in one element skipped the step on
one rank only: the ranks then diverged (memsave's agreement check named a control-flow divergence the user did not
write, or a collective timed out), and their scales would have diverged too (a review). torch's
``ShardedGradScaler`` all-reduces the flag for FSDP.

Here :class:`MemsaveOptimizer` says it handles the scaling (``_step_supports_amp_scaling``), so ``scaler.step``
calls ``optimizer.step(grad_scaler=scaler)`` on every rank (the optimizer object the user built routes there
too): the step unscales (unless the user did), takes the MAX of the inf flags over every rank of the model,
writes it back into the scaler's per-device flags (so each rank's ``scaler.update()`` backs off or grows alike),
and steps or skips on all ranks together. The same path at
one rank gives GradScaler's own result, bit for bit. torch announces (a ``FutureWarning``) that it will stop
passing itself to optimizers that take ``grad_scaler``; that warning, addressed to optimizer authors, is silenced
here, and the path reads the scaler's per-optimizer state (``_per_optimizer_states``, torch's private state:
the attributes torch sets instead give no way to write the agreed flag back for ``update()``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from memsave import dist as mdist

__all__ = ["GRAD_SCALER_REFUSED", "GradScalerSteps", "step_with_grad_scaler"]

GRAD_SCALER_REFUSED = (
    "torch.amp.GradScaler on a model wrapped with a bf16/fp16 profile: the profile already scales the loss and "
    "unscales the gradients into fp32 masters ([precision] loss_scale). Drop the scaler: call loss.backward() (or "
    "optimizer.backward(loss)) and optimizer.step(); optimizer.mp.loss_scale is the scale, "
    "optimizer.clip_grad_norm(c) clips the unscaled gradient. (GradScaler with torch.autocast belongs to an fp32 "
    "profile.)")

warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def step_with_grad_scaler(optimizer: Any, scaler: Any, device: torch.device) -> bool:
    """Unscale (unless the user did), agree on an overflow over every rank, record it for ``scaler.update()``;
    returns whether to step ([Note: one skip decision for GradScaler])."""
    from torch.amp.grad_scaler import OptState

    # the object the scaler was given: the wrapper, or the user's own (whose step routes here)
    given = optimizer.optimizer if id(optimizer.optimizer) in scaler._per_optimizer_states else optimizer
    state = scaler._per_optimizer_states[id(given)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(given)  # (the same tensors either way: the two share their param_groups)
    flags = state["found_inf_per_device"]
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for flag in flags.values():
        found += flag.to(device)
    mdist.all_reduce(found, None, op=mdist.ReduceOp.MAX, count_as="control")
    for flag in flags.values():
        flag.copy_(found.squeeze(0).to(flag.device))  # (no host sync for the flags)
    return found.item() == 0


class GradScalerSteps:
    """What :class:`~memsave.engines.MemsaveOptimizer` tells ``torch.amp.GradScaler`` (``self.mp``: its mixed
    precision, ``self.engine``: its engine)."""

    mp: Any
    engine: Any

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by ``torch.amp.GradScaler.step`` (its hook for optimizers that scale by themselves). Under a bf16/fp16
        profile memsave scales and unscales the loss itself, and the scaler would find no gradients on the fp32
        masters (torch's bare "No inf checks were recorded"): refused by name. Under fp32, ``step(grad_scaler=)``
        ([Note: one skip decision for GradScaler])."""
        if self.mp is not None:
            raise NotImplementedError(GRAD_SCALER_REFUSED)
        return True

    def _scaler_says_step(self, scaler: Any) -> bool:
        """The user's own optimizer object routes its ``step`` here too (``scaler.step(optimizer)`` with the
        object built before wrap; memsave/wrapped.py route_user_optimizer): refused alike under bf16/fp16."""
        if self._step_supports_amp_scaling:
            return step_with_grad_scaler(self, scaler, self.engine.mesh.device)
        return True
