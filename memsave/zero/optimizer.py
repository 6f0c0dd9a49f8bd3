"""The sharded optimizer: the user's own optimizer instance, stepping only this rank's rows.

The instance is kept (its class, hyperparameters and param groups; LR schedulers built on it keep working);
only the tensors in its ``param_groups`` are replaced by this rank's shards. That is exact for optimizers
whose update is elementwise (SGD, Adam, AdamW, RMSprop, ...). Optimizers with per-tensor statistics
(LBFGS, torch's Adafactor) are refused; :class:`memsave.optim.Adafactor` is told it steps row shards and reduces
its column statistics and RMS sums over dp itself ([Note: Adafactor under row sharding] in memsave/optim/).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave._logging import warn_once
from memsave.config import OffloadConfig
from memsave.optim import Adafactor
from memsave.phases import MemoryCategory
from memsave.precision import LossScaler, MixedPrecisionOptimizer
from memsave.precision.nonfinite import NonfiniteGuard
from memsave.precision.optimizer import follow
from memsave.wrapped import MemsaveOptimizer, route_zero_grad, weak_method
from memsave.zero.engine import ZeroEngine
from memsave.zero.layout import ShardLayout

__all__ = ["ZeroOptimizer"]

_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "ASGD", "Rprop"}
_NOT_SHARDABLE = {"LBFGS", "SparseAdam", "Adafactor", "Muon"}


class ZeroOptimizer(MemsaveOptimizer):
    """ZeRO's optimizer half: sharded state, global-norm clipping, consolidated state dicts."""

    @staticmethod
    def check(optimizer: torch.optim.Optimizer, stage: int) -> None:
        """Refuse what cannot be sharded exactly, before anything is changed."""
        name = type(optimizer).__name__
        if isinstance(optimizer, Adafactor):
            name = "memsave.optim.Adafactor"  # sharding-aware
        elif name in _NOT_SHARDABLE:
            raise NotImplementedError(
                f"{name} keeps per-tensor statistics, so stepping row shards independently would change its "
                f"updates; with ZeRO stage {stage} use an elementwise optimizer (AdamW, SGD, ...) or "
                "memsave.optim.Adafactor, which stays exact under sharding"
            )
        if optimizer.state:
            raise ValueError(
                f"optimizer already has state for {len(optimizer.state)} parameters; memsave.wrap must come before "
                "the first step (load a checkpoint with optimizer.load_state_dict after wrapping)"
            )
        if name not in _ELEMENTWISE and not isinstance(optimizer, Adafactor):
            warn_once(f"ZeRO assumes {name} updates each element independently; if it does not, results differ")

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ZeroEngine, *, mixed_precision: bool = False,
                 scaler: LossScaler | None = None, offload: OffloadConfig | None = None,
                 nonfinite: NonfiniteGuard | None = None) -> None:
        super().__init__(optimizer)
        self.nonfinite = nonfinite if nonfinite is not None else NonfiniteGuard()
        self.check(optimizer, engine.stage)
        self.engine = engine
        self.scaler = scaler
        engine.loss_scaled = scaler is not None
        engine.load_listeners.append(weak_method(self._refresh_masters))
        route_zero_grad(optimizer, self)
        self._full_of: dict[torch.Tensor, nn.Parameter] = {}
        for group in optimizer.param_groups:
            shards = []
            for p in group["params"]:
                shard = engine.shard_of[p]
                self._full_of[shard] = p
                shards.append(shard)
            group["params"] = shards
        # Mixed precision: the optimizer steps fp32 master shards (4/N bytes per parameter), cast into the
        # compute-dtype shards after the step; overflow is agreed over dp (each rank checks its own rows).
        # With offload on CUDA the masters are made on the host and go to the tier from there: the device never
        # holds 4 bytes per parameter of them ([Note: offloaded masters] in memsave/offload/state.py).
        host_masters = (offload is not None and offload.optimizer == "cpu" and engine.mesh.device.type == "cuda")
        self.mp = (MixedPrecisionOptimizer(optimizer, scaler=scaler, group=engine.group, grad_of=engine.shard_grad,
                                           master_device=torch.device("cpu") if host_masters else None,
                                           nonfinite=self.nonfinite)
                   if mixed_precision or scaler is not None else None)
        # what the optimizer steps (a shard, or its master) -> the full parameter
        self._opt_full = ({m: self._full_of[s] for m, s in self.mp._pairs} if self.mp is not None
                          else dict(self._full_of))
        if isinstance(optimizer, Adafactor):
            group_ = engine.group
            optimizer.shard(lambda t: mdist.all_reduce(t, group_), {s: p.shape for s, p in self._opt_full.items()})
        # [offload] optimizer: the state of this rank's shards streamed from its tier (memsave/zero/offload.py)
        self.offloaded, self.param_offload = None, None
        if offload is not None and offload.optimizer != "none":
            from memsave.zero.offload import build_offloaded_state

            masters: dict[torch.Tensor, torch.Tensor] = (
                {m: s for m, s in self.mp._pairs if m is not s} if self.mp is not None else {})
            self.offloaded, self.param_offload = build_offloaded_state(optimizer, engine, offload, masters=masters)
        # [offload] overlap: the offloaded chunks step in the background; a unit's gather waits for its rows, the
        # end of the next forward for all of them ([Note: overlapped step] in memsave/offload/state.py)
        self.overlap = self.offloaded is not None and offload is not None and offload.overlap
        self._settle_hook = None
        if self.overlap:
            state = self.offloaded
            assert state is not None
            engine.attach_step_waiter(lambda unit: state.wait_for(f"unit{unit.index}"))
            engine.before_zero_in_place = weak_method(self.settle)
            self._settle_hook = engine.model.register_forward_hook(lambda *_: state.settle())

    # -- the step ------------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for an optimizer step still running in the background (``[offload] overlap``); raise its error."""
        if self.offloaded is not None:
            self.offloaded.settle()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.settle()  # the reduce-scatters write the gradient buffers a background step may still read
        before = self.engine.num_syncs
        self.engine.in_scaled_backward = True
        try:
            (self.mp.scale(loss) if self.mp is not None else loss).backward(**kwargs)
        finally:
            self.engine.in_scaled_backward = False
        if self.engine.require_grad_sync and self.engine.num_syncs == before:
            self.engine.agreement.check("backward")  # as the peers' first gradient hook does
            self.engine._finalize_backward()  # no gradient reached this rank's parameters; peers still sync

    def _shard_grads(self) -> list[torch.Tensor]:
        return [s.grad for s in self._full_of if s.grad is not None]

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of the full gradient, computed from the shards with one all-reduce (under
        mixed precision: of the unscaled fp32 master gradients; inf, on every rank, when any overflowed)."""
        if self.mp is not None and self.mp._unscale():
            return torch.tensor(math.inf)
        grads = [m.grad for m in self._opt_full if m.grad is not None] if self.mp is not None else self._shard_grads()
        device = self.engine.mesh.device
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads if g.numel()]).max() if grads else torch.zeros(())
            total = local.to(device, torch.float32).reshape(1)
            mdist.all_reduce(total, self.engine.group, op=mdist.ReduceOp.MAX)
            norm = total[0]
        else:
            norms = torch._foreach_norm(grads, norm_type) if grads else []
            local = torch.stack([n.float() ** norm_type for n in norms]).sum() if norms else torch.zeros(())
            total = local.to(device).reshape(1)
            mdist.all_reduce(total, self.engine.group)
            norm = total[0] ** (1.0 / norm_type)
        self.nonfinite.norm = float(norm)  # the step's non-finite check reuses this global norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm

    @torch.no_grad()
    def _refresh_masters(self, loaded: dict[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After ``model.load_state_dict``: the fp32 masters become the loaded parameters (else the next step would
        copy the old weights back)."""
        if self.mp is None:
            return
        if self.offloaded is None:
            self.mp.refresh_masters()
            return
        states, own = self.offloaded.local()
        rows = loaded if loaded is not None else {}  # [offload] params: the shards' rows, read while loaded
        for m, s in self.mp._pairs:
            if m is not s:
                new = rows.get(s, s).detach()
                own[m] = follow(own[m], new) if m in own else new.float()
        self.offloaded.load_local_state(states, own)

    def _step(self) -> None:
        agreement = self.engine.agreement
        mdist.doing(agreement.step, "optimizer.step()")
        agreement.check("optimizer")  # [Note: control-flow agreement] in memsave/dist/agreement.py
        agreement.step += 1
        self.engine.reshard_all()  # stage 3: units gathered on access would hold the weights before the step
        if self.mp is not None:
            offloaded = self.offloaded
            step = (lambda: offloaded.step(overlap=self.overlap)) if offloaded is not None else None
            self.mp._step(step)  # or skips it, on every rank
            if self.mp.last_step_skipped:
                return
        else:
            skip = self.nonfinite.found(self._shard_grads(), self.engine.group, device=self.engine.mesh.device)
            self.nonfinite.after_step(skip)  # agreed over dp: every rank skips, or none
            if skip:
                return
            if self.offloaded is not None:
                self.offloaded.step(overlap=self.overlap)
            else:
                self.optimizer.step()
        if self.offloaded is not None and self.engine.mesh.device.type == "cpu":
            mdist.after_forward()  # the host policy's trim: the chunks' transients go back to the OS too
        self.engine.gather_params_after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)  # (in place, it first waits for a background step that reads them)
        if self.mp is not None:
            self.mp.zero_grad(set_to_none)

    # -- consolidated state dicts --------------------------------------------------------------------------
    @staticmethod
    def _full_shape(value: torch.Tensor, full_param: torch.Tensor) -> torch.Size:
        """The full shape of a row-sharded tensor: the parameter's rows, the value's own trailing dims."""
        return full_param.shape if full_param.dim() == 0 else torch.Size((full_param.shape[0], *value.shape[1:]))

    def _gather_full(self, shard: torch.Tensor, full_param: torch.Tensor) -> torch.Tensor:
        """All-gather a row-sharded tensor (the parameter's rows, any trailing dims) into its full shape
        (collective)."""
        shape = self._full_shape(shard, full_param)
        layout = ShardLayout([shape], self.engine.dp_size)
        chunk = torch.zeros(layout.chunk_numel, dtype=shard.dtype, device=shard.device)
        layout.shard_view(chunk, 0, self.engine.mesh.dp_rank).view_as(shard).copy_(shard)
        out = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
        mdist.all_gather_into(out, chunk, self.engine.group)
        full = torch.empty(shape, dtype=shard.dtype, device=shard.device)
        layout.unpack(out, 0, full)
        return full

    def _own_rows(self, value: torch.Tensor, full_param: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full row-sharded tensor."""
        rows = full_param.shape[0] if full_param.dim() else 1
        start, stop = ShardLayout([full_param.shape], self.engine.dp_size).slots[0].local_rows(self.engine.mesh.dp_rank)
        if full_param.dim() == 0:
            return value.reshape(1)[start:stop]
        return value.reshape(rows, -1)[start:stop].view(stop - start, *value.shape[1:])

    def _is_per_element(self, key: str, value: Any, like: torch.Tensor, full_param: torch.Tensor) -> bool:
        """A state entry sharded by rows like the parameter (exp_avg, momentum_buffer, Adafactor's row_var, ...),
        not one every rank holds whole (``step``, the column statistics of a 2-D parameter)."""
        if not isinstance(value, torch.Tensor) or key == "step":
            return False
        if isinstance(self.optimizer, Adafactor):
            return self.optimizer.state_is_row_sharded(key, full_param.shape)
        return value.shape == like.shape and (value.dim() > 0 or full_param.dim() == 0)

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state, in the plain optimizer's format (collective: call on every rank)."""
        mdist.expect_every_rank("optimizer.state_dict() under ZeRO", self.engine.group)
        self.settle()
        sd = self.optimizer.state_dict()
        shards = [s for g in self.optimizer.param_groups for s in g["params"]]
        own: dict[torch.Tensor, torch.Tensor] = {}  # offloaded fp32 masters
        if self.offloaded is not None:  # the state of every shard is in the offload store, in the plain format
            local, own = self.offloaded.local()
            sd["state"] = {i: local[s] for i, s in enumerate(shards) if s in local}
        for index, live in sd["state"].items():
            shard = shards[index]
            full_param = self._opt_full[shard]
            state = sd["state"][index] = dict(live)  # torch hands out the live per-parameter dicts
            for key in sorted(state):
                if self._is_per_element(key, state[key], shard, full_param):
                    state[key] = self._gather_full(state[key], full_param)
        if self.mp is not None:  # the format of MixedPrecisionOptimizer's, consolidated
            sd["master_params"] = [self._gather_full(own.get(m, m).detach(), self._opt_full[m]) for m in shards]
            sd["loss_scaler"] = self.scaler.state_dict() if self.scaler is not None else None
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (plain-optimizer) state dict: every rank keeps its rows."""
        self.settle()
        shards = [s for g in self.optimizer.param_groups for s in g["params"]]
        sharded: dict[str, Any] = {"param_groups": state_dict["param_groups"], "state": {}}
        for index, state in state_dict["state"].items():
            shard = shards[int(index)]
            full_param = self._opt_full[shard]
            out = {}
            for key, value in state.items():
                if self._is_per_element(key, value, full_param, full_param):
                    out[key] = self._own_rows(value.to(shard.device), full_param).clone()
                else:  # never alias the caller's tensors (e.g. Adam's step, which is incremented in place)
                    out[key] = value.clone() if isinstance(value, torch.Tensor) else value
            sharded["state"][index] = out
        if self.mp is None:
            self.optimizer.load_state_dict(sharded)
            if self.offloaded is not None:  # into the store: the live optimizer holds no offloaded state
                self.offloaded.load_local_state({s: self.optimizer.state.pop(s) for s in shards
                                                 if s in self.optimizer.state})
            return
        masters = state_dict.get("master_params")
        if masters is not None:
            sharded["master_params"] = [self._own_rows(m.to(s.device, torch.float32), self._opt_full[s]).clone()
                                        for m, s in zip(masters, shards)]
        sharded["loss_scaler"] = state_dict.get("loss_scaler")
        if self.offloaded is None:
            self.mp.load_state_dict(sharded)
            return
        # offloaded masters ([Note: offloaded masters] in memsave/offload/state.py): they go into the store with
        # the state (absent from a plain optimizer's state dict: kept as they are)
        self.optimizer.load_state_dict({"param_groups": sharded["param_groups"], "state": sharded["state"]})
        own = {s: m for s, m in zip(shards, sharded["master_params"])} if masters is not None else None
        self.offloaded.load_local_state({s: self.optimizer.state.pop(s) for s in shards if s in self.optimizer.state},
                                        own)
        if self.scaler is not None and sharded["loss_scaler"] is not None:
            self.scaler.load_state_dict(sharded["loss_scaler"])

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The averaged full gradient of every trainable parameter, by name (collective; for checks/debugging)."""
        out: dict[str, torch.Tensor | None] = {}
        grads = {s: self.engine.shard_grad(s) for s in self._full_of}
        flags = torch.tensor([g is not None for g in grads.values()], dtype=torch.int32)
        mdist.all_reduce(flags, self.engine.group)
        master_of = {s: m for m, s in self.mp._pairs} if self.mp is not None else {}
        for (shard, p), has in zip(self._full_of.items(), flags.tolist()):
            if not p.requires_grad:
                continue
            name = self.engine.name_of[shard]
            master = master_of.get(shard)
            grad = grads[shard]
            if master is not None and master is not shard and master.grad is not None:
                grad = master.grad  # unscaled already (clip_grad_norm ran)
            elif grad is None:
                grad = torch.zeros_like(shard)
            elif self.scaler is not None and not (master is shard and self.mp is not None and self.mp.unscaled):
                grad = grad.float() / self.scaler.scale  # the user sees unscaled gradients
            out[name] = self._gather_full(grad, p) if has else None
        return out

    def memory_tensors(self) -> Iterator[tuple[MemoryCategory, torch.Tensor]]:
        yield from self.engine.memory_tensors()
        if self.mp is not None:
            yield from self.mp.master_tensors()
        yield from self._optimizer_state_tensors()
        if self.offloaded is not None:
            yield from self.offloaded.memory_tensors()  # the window buffers and the chunks kept in memory
        if self.param_offload is not None:
            yield from self.param_offload.memory_tensors()

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes held off the device now, by tier (``"host"``, ``"disk"``): optimizer state, and at stage 3 with
        ``[offload] params`` the parameter shards (see :meth:`offloaded_param_bytes`)."""
        out = self.offloaded.offloaded_bytes() if self.offloaded is not None else {"host": 0, "disk": 0}
        if self.param_offload is not None:
            for tier, n in self.param_offload.offloaded_bytes().items():
                out[tier] += n
        return out

    def offloaded_param_bytes(self) -> int:
        """Stage 3 with ``[offload] params``: the parameter shard bytes held on the tier (disk or pinned host)."""
        return sum(self.param_offload.offloaded_bytes().values()) if self.param_offload is not None else 0

    def close(self) -> None:
        """Release the offload tier (its files are removed); the optimizer cannot step afterwards."""
        if self._settle_hook is not None:
            self._settle_hook.remove()
        try:
            self.settle()
        finally:
            if self.param_offload is not None:
                self.param_offload.drain()
            if self.offloaded is not None:
                self.offloaded.close()
