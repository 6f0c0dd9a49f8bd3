"""Adafactor with factored second moments, exact under dim-0 (row) sharding.

Shazeer & Stern, 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost" (arXiv:1804.04235).
Arguments map onto the paper's symbols (Algorithms 4 and 5, sections 5-7):

=====================  ===========  ==================================================================
argument               symbol       meaning
=====================  ===========  ==================================================================
``lr``                 rho_t        explicit step size (scheduled by the user); ``None``: relative steps
``relative_step``      rho_t        rho_t = min(1e-2, 1/sqrt(t)) (or min(1e-6 t, 1/sqrt(t)) with
                                    ``warmup_init``)
``scale_parameter``    alpha_t      alpha_t = max(eps2, RMS(X_{t-1})) rho_t; else alpha_t = rho_t
``eps``                eps1, eps2   eps1 is added to G^2 (regularizes the factors), eps2 floors RMS(X)
``clip_threshold``     d            U_t / max(1, RMS(U_t) / d)
``decay_rate``         c            beta2_t = 1 - t^c (c = -0.8 in the paper)
``beta1``              beta1        first moment of the clipped, scaled update (section 6); ``None``: off
``momentum_dtype``                  dtype of the first moment (bfloat16 keeps it at 2 bytes/parameter)
``weight_decay``       lambda       decoupled: X <- X (1 - rho_t lambda), as AdamW does with its lr
=====================  ===========  ==================================================================

For a tensor with >= 2 dims the second moment is factored over its last two dims: R (rows, ``row_var``, shape
``(..., n, 1)``) and C (columns, ``col_var``, ``(..., 1, m)``) are running means of G^2 + eps1 over the
columns and rows, and V = R C / mean(R). Vectors (and 0-dim tensors) keep the full ``variance``.

[Note: Adafactor under row sharding] ZeRO shards each parameter along dim 0, whole rows per rank. Then R is
local, but C, mean(R), RMS(X) and RMS(U) sum over rows other ranks hold. Every step reduces, in *one*
all-reduce for all tensors, each rank's partial sums: per factored 2-D tensor the column sums of G^2, the sum
of R and D = sum_rows(G^2 / R) (length m each), and per tensor sum(X^2) (and sum(U^2) where it is local).
RMS(U) needs no second round because U^2 = G^2 mean(R) / (R C), so sum(U^2) = mean(R) * sum_cols(D / C).
Without sharding the same formulas run with the reduction skipped, so a sharded run equals an unsharded one
up to the order of floating-point sums. Tensors with > 2 dims are sharded along a dim the factors do not
span, so only their RMS sums travel. :class:`memsave.engines.MemsaveOptimizer` calls :meth:`Adafactor.shard`.

Where this differs from ``torch.optim.Adafactor`` (which follows the paper except as its docs say): torch adds
eps1 as a floor on mean(R) and on V instead of adding it to G^2, and its ``lr`` caps the relative step
(rho_t = min(lr, 1/sqrt(t))) and scales weight decay by that cap. With ``eps=(1e-30, 1e-3)``, no weight decay
and torch's default ``lr=1e-2``, the two compute the same update (tested), up to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch

__all__ = ["Adafactor"]

Reduce = Callable[[torch.Tensor], object]  # sums a tensor in place over the ranks that share the parameters


def _check_settings(g: dict[str, Any]) -> None:
    """Refuse contradicting or out-of-range settings (of the defaults, or of one param group over them)."""
    if g["relative_step"] is None:
        g["relative_step"] = g["lr"] is None
    lr, relative_step, eps, beta1, momentum_dtype = (g[k] for k in ("lr", "relative_step", "eps", "beta1",
                                                                    "momentum_dtype"))
    if lr is not None and relative_step:
        raise ValueError(f"Adafactor: lr={lr} contradicts relative_step=True (the step size is then computed); "
                         "drop lr, or pass relative_step=False")
    if lr is None and not relative_step:
        raise ValueError("Adafactor: relative_step=False needs an explicit lr; pass lr=..., or drop relative_step")
    if lr is not None and not lr > 0:
        raise ValueError(f"Adafactor: lr={lr} is not allowed; expected a positive number")
    if g["warmup_init"] and not relative_step:
        raise ValueError("Adafactor: warmup_init=True warms up the relative step, which lr= replaces; drop "
                         "warmup_init or lr")
    if len(eps) != 2 or not eps[0] > 0 or not eps[1] >= 0:
        raise ValueError(f"Adafactor: eps={eps} is not allowed; expected (eps1 > 0, eps2 >= 0)")
    if not g["clip_threshold"] > 0:
        raise ValueError(f"Adafactor: clip_threshold={g['clip_threshold']} is not allowed; expected d > 0")
    if not -1.0 <= g["decay_rate"] < 0.0:
        raise ValueError(f"Adafactor: decay_rate={g['decay_rate']} is not allowed; expected -1 <= c < 0 (paper: -0.8)")
    if beta1 is not None and not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Adafactor: beta1={beta1} is not allowed; expected None or a number in [0, 1)")
    if momentum_dtype is not None and beta1 is None:
        raise ValueError(f"Adafactor: momentum_dtype={momentum_dtype} has no first moment to store; set beta1 "
                         "or drop momentum_dtype")
    if momentum_dtype is not None and not momentum_dtype.is_floating_point:
        raise ValueError(f"Adafactor: momentum_dtype={momentum_dtype} is not a floating-point dtype")
    if not g["weight_decay"] >= 0:
        raise ValueError(f"Adafactor: weight_decay={g['weight_decay']} is not allowed; expected a number >= 0")


class Adafactor(torch.optim.Optimizer):
    """Factored-second-moment optimizer (see the module docstring for the paper symbols and sharding)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = None,
        *,
        relative_step: bool | None = None,
        warmup_init: bool = False,
        scale_parameter: bool = True,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        momentum_dtype: torch.dtype | None = None,
        weight_decay: float = 0.0,
        maximize: bool = False,
        foreach: bool = True,
    ) -> None:
        defaults = dict(lr=lr, relative_step=relative_step, warmup_init=warmup_init, scale_parameter=scale_parameter,
                        eps=tuple(eps), clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
                        momentum_dtype=momentum_dtype, weight_decay=weight_decay, maximize=maximize)
        _check_settings(defaults)  # the defaults alone first: their message then names no group
        super().__init__(params, defaults)
        self.foreach = foreach
        self._reduce: Reduce | None = None
        self._full_shapes: dict[torch.Tensor, torch.Size] = {}
        self.last_reduce_seconds = 0.0  # time in the sharded reduction during the last step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Also checks the group's settings (its own keys over the defaults): a group that sets ``lr`` while
        the defaults use relative steps would otherwise have its lr silently ignored."""
        if param_group.get("relative_step") is None and "lr" in param_group:
            param_group = {**param_group, "relative_step": param_group["lr"] is None}
        super().add_param_group(param_group)
        try:
            _check_settings(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts floating state to the parameter's dtype; a bfloat16 first moment must stay bfloat16
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            dtype = group["momentum_dtype"]
            for p in group["params"]:
                st = self.state.get(p, {})
                if dtype is not None and "exp_avg" in st:
                    st["exp_avg"] = st["exp_avg"].to(dtype)

    # -- sharding ----------------------------------------------------------------------------------------------
    def shard(self, reduce: Reduce, full_shapes: dict[torch.Tensor, torch.Size]) -> None:
        """Step row shards: ``full_shapes`` maps each shard to its full parameter's shape, ``reduce`` sums a
        tensor in place over the ranks holding the other rows (see [Note: Adafactor under row sharding])."""
        self._reduce, self._full_shapes = reduce, dict(full_shapes)

    def state_is_row_sharded(self, key: str, full_shape: torch.Size) -> bool:
        """Whether state ``key`` of a parameter holds one slice per parameter row (so gathers along dim 0 under
        sharding); ``col_var`` of a 2-D parameter and ``step`` are the same on every rank."""
        if key == "step":
            return False
        return not (key == "col_var" and len(full_shape) == 2)

    def _full_shape(self, p: torch.Tensor) -> torch.Size:
        return self._full_shapes.get(p, p.shape)

    # -- the step ----------------------------------------------------------------------------------------------
    def _step_sizes(self, group: dict[str, Any], step: float, rms: float) -> tuple[float, float]:
        """(rho_t, alpha_t) for one parameter."""
        if group["relative_step"]:
            cap = 1e-6 * step if group["warmup_init"] else 1e-2
            rho = min(cap, 1.0 / math.sqrt(step))
        else:
            rho = float(group["lr"])
        alpha = max(group["eps"][1], rms) * rho if group["scale_parameter"] else rho
        return rho, alpha

    def _init_state(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if p.dim() >= 2:
                state["row_var"] = p.new_zeros((*p.shape[:-1], 1))
                state["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
            else:
                state["variance"] = torch.zeros_like(p)
            if group["beta1"] is not None:
                state["exp_avg"] = torch.zeros_like(p, dtype=group["momentum_dtype"] or p.dtype)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_reduce_seconds = 0.0
        pending: list[tuple[Generator[list[torch.Tensor], None, None], list[torch.Tensor]]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse or torch.is_complex(p):
                    raise NotImplementedError("Adafactor supports dense real parameters only")
            if not params:
                continue
            if self.foreach:  # runs up to its reduction; finished below, after one all-reduce for every group
                steps = self._foreach_group(group, params)
                pending.append((steps, next(steps)))
            else:
                self._single_group(group, params)
        if self._reduce is not None and pending:
            parts = [t for _, group_parts in pending for t in group_parts]
            flat = torch.cat(parts)
            self._timed_reduce(flat)
            for t, piece in zip(parts, flat.split([t.numel() for t in parts])):
                t.copy_(piece)
        for steps, _ in pending:
            next(steps, None)
        return loss

    def _timed_reduce(self, flat: torch.Tensor) -> None:
        assert self._reduce is not None
        import time

        start = time.perf_counter()
        self._reduce(flat)
        self.last_reduce_seconds += time.perf_counter() - start

    def _foreach_group(
        self, group: dict[str, Any], params: list[torch.Tensor]
    ) -> Generator[list[torch.Tensor], None, None]:
        """All tensors of a group at once: elementwise work in ``torch._foreach_*`` calls, per-tensor reductions
        along dims, one host sync for every per-tensor scalar. A generator: it yields the partial sums to be
        added over the ranks (nothing when not sharded), which :meth:`step` reduces in place, for all groups
        in one all-reduce, before resuming it."""
        eps1, d, c = group["eps"][0], group["clip_threshold"], group["decay_rate"]
        states = [self._init_state(group, p) for p in params]
        grads: list[torch.Tensor] = [p.grad for p in params if p.grad is not None]
        if group["maximize"]:
            grads = list(torch._foreach_neg(grads))
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        step_values = torch.stack(steps).tolist()
        full = [self._full_shape(p) for p in params]
        g2 = list(torch._foreach_mul(grads, grads))
        factored = [k for k, p in enumerate(params) if p.dim() >= 2]
        vectors = [k for k, p in enumerate(params) if p.dim() < 2]
        one_minus_beta2 = [t**c for t in step_values]
        # local statistics; X^2 sums are taken before the update (alpha_t uses RMS(X_{t-1}))
        sq = [n * n for n in torch._foreach_norm(params)] if params else []
        colsums: dict[int, torch.Tensor] = {}
        dsums: dict[int, torch.Tensor] = {}
        rsums: dict[int, torch.Tensor] = {}
        for k in factored:
            st, g = states[k], g2[k]
            st["row_var"].lerp_(g.mean(dim=-1, keepdim=True).add_(eps1), one_minus_beta2[k])
            colsums[k] = g.sum(dim=-2, keepdim=True)  # (..., 1, m)
            dsums[k] = torch.matmul(st["row_var"].reciprocal().mT, g)  # sum_rows(G^2 / R): (..., 1, m)
            rsums[k] = st["row_var"].sum(dim=-2, keepdim=True)  # (..., 1, 1)
        usq: dict[int, torch.Tensor] = {}
        if vectors:
            vs = [states[k]["variance"] for k in vectors]
            vg2 = [g2[k] for k in vectors]
            torch._foreach_add_(vg2, eps1)
            torch._foreach_lerp_(vs, vg2, [one_minus_beta2[k] for k in vectors])
            inv = torch._foreach_rsqrt(vs)  # 1 / sqrt(V)
            torch._foreach_mul_(inv, [grads[k] for k in vectors])  # U
            for k, u in zip(vectors, inv):
                g2[k] = u  # reuse the slot: U for vectors
            for k, n in zip(vectors, torch._foreach_norm(inv)):
                usq[k] = n * n
        split = [k for k in factored if len(full[k]) == 2] if self._reduce is not None else []
        # sharded tensors with > 2 dims: every slice's rows are local, so their partial sum(U^2) joins the reduce
        for k in (k for k in factored if self._reduce is not None and k not in split):
            st = states[k]
            cvar = st["col_var"].lerp(colsums[k].div(full[k][-2]).add_(eps1), one_minus_beta2[k])
            mean_r = rsums[k].div(full[k][-2])
            usq[k] = (mean_r * dsums[k] / cvar).sum()
        # partial sums to add over the ranks; step() reduces every group's in one all-reduce, in place
        parts: list[torch.Tensor] = []
        if self._reduce is not None:
            sq_t = torch.stack(sq)
            usq_keys = sorted(usq)
            usq_t = torch.stack([usq[k] for k in usq_keys]) if usq else sq_t.new_zeros(0)
            parts = [sq_t, usq_t]
            for k in split:
                parts += [colsums[k].view(-1), dsums[k].view(-1), rsums[k].view(-1)]  # views: reduced in place
        yield parts
        if self._reduce is not None:
            sq = list(sq_t.unbind())
            usq.update(zip(usq_keys, usq_t.unbind()))
        # factored tensors: C and mean(R), and sum(U^2) where it was not local, all without forming U
        mean_rs: dict[int, torch.Tensor] = {}
        for k in factored:
            st, rows = states[k], full[k][-2]
            st["col_var"].lerp_(colsums[k].div_(rows).add_(eps1), one_minus_beta2[k])
            mean_rs[k] = rsums[k].div_(rows)
            if k not in usq:
                usq[k] = (mean_rs[k] * dsums[k] / st["col_var"]).sum()
        numels = [math.prod(s) if len(s) else 1 for s in full]
        scalars = torch.stack([torch.stack(sq), torch.stack([usq[k] for k in range(len(params))])]).tolist()
        coefs, decays = [], []
        for k in range(len(params)):
            rho, alpha = self._step_sizes(group, step_values[k], math.sqrt(scalars[0][k] / numels[k]))
            clip = max(1.0, math.sqrt(scalars[1][k] / numels[k]) / d)
            coefs.append(alpha / clip)
            decays.append(1.0 - rho * group["weight_decay"])
        # the scaled update alpha_t U_t / clip: for factored tensors G * (coef / sqrt(R / mean(R))) / sqrt(C), the
        # scalar folded into the small row factor (one pass over G fewer)
        for k in factored:
            st = states[k]
            r_factor = (st["row_var"] / mean_rs[k]).rsqrt_().mul_(coefs[k])  # (..., n, 1)
            torch.mul(grads[k], r_factor, out=g2[k]).mul_(st["col_var"].rsqrt())
        if vectors:
            torch._foreach_mul_([g2[k] for k in vectors], [coefs[k] for k in vectors])
        if group["weight_decay"]:
            torch._foreach_mul_(params, decays)
        updates = g2
        if group["beta1"] is not None:
            beta1 = group["beta1"]
            avgs = [s["exp_avg"] for s in states]
            # e.g. bfloat16 momentum: one cast, then a same-dtype lerp (2x faster than a mixed-dtype mul + add)
            updates = [u.to(a.dtype) for u, a in zip(updates, avgs)]
            torch._foreach_lerp_(avgs, updates, 1.0 - beta1)  # m <- beta1 m + (1 - beta1) u
            updates = avgs
        torch._foreach_sub_(params, updates)

    def _single_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """The plain per-tensor path: the paper's formulas written out literally (V materialized, RMS(U) from
        U), one tensor at a time and two reductions per sharded tensor. The reference the foreach path is
        tested against."""
        eps1, d, c = group["eps"][0], group["clip_threshold"], group["decay_rate"]
        for p in params:
            st = self._init_state(group, p)
            assert p.grad is not None
            g = -p.grad if group["maximize"] else p.grad
            full = self._full_shape(p)
            st["step"] += 1
            t = float(st["step"])
            one_minus_beta2 = t**c
            sums = torch.stack([p.square().sum()])
            if p.dim() >= 2:
                st["row_var"].lerp_((g * g + eps1).mean(dim=-1, keepdim=True), one_minus_beta2)
                col = (g * g + eps1).sum(dim=-2, keepdim=True)
                r_sum = st["row_var"].sum(dim=-2, keepdim=True)
                if self._reduce is not None and len(full) == 2:
                    flat = torch.cat([sums, col.reshape(-1), r_sum.reshape(-1)])
                    self._timed_reduce(flat)
                    sums, col, r_sum = flat[:1], flat[1:-1].view_as(col), flat[-1:].view_as(r_sum)
                st["col_var"].lerp_(col / full[-2], one_minus_beta2)
                v = st["row_var"] * st["col_var"] / (r_sum / full[-2])
            else:
                st["variance"].lerp_(g * g + eps1, one_minus_beta2)
                v = st["variance"]
            u = g / v.sqrt()
            u_sq = torch.stack([u.square().sum()])
            if self._reduce is not None:
                if not (p.dim() >= 2 and len(full) == 2):
                    sums = torch.cat([sums, u_sq])
                    self._timed_reduce(sums)
                    sums, u_sq = sums[:1], sums[1:]
                else:
                    self._timed_reduce(u_sq)
            numel = math.prod(full) if len(full) else 1
            rho, alpha = self._step_sizes(group, t, math.sqrt(float(sums[0]) / numel))
            u = u / max(1.0, math.sqrt(float(u_sq[0]) / numel) / d)
            if group["weight_decay"]:
                p.mul_(1.0 - rho * group["weight_decay"])
            u = u * alpha
            if group["beta1"] is not None:
                st["exp_avg"].lerp_(u.to(st["exp_avg"].dtype), 1.0 - group["beta1"])
                u = st["exp_avg"]
            p.sub_(u)
