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

[Note: Adafactor under row sharding] ZeRO cuts each stepped tensor along dim 0 over dp (whole rows per rank);
tensor parallelism cuts it over tp along its rows (``Shard(0)``) or columns (``Shard(1)``). Each stepped tensor
has a :class:`~memsave.optim.adafactor_shard.Layout`: the axes A_r cutting its rows, A_c cutting its columns,
and its whole shape. Each step reduces per-rank partial sums in up to three rounds, each round one flat
all-reduce per distinct axis set, for all tensors and groups together: (1) where A_c is non-empty, the row sums
of G^2 over A_c (R must be the whole row's: the new row means are those sums over the whole column count);
(2) over A_r, per factored tensor the column sums of G^2, the sum of R and D = sum_rows(G^2 / R) (length m
each), and per tensor sum(X^2) (and sum(U^2) where its rows are whole) over every axis cutting it; (3) where A_r
and A_c are both non-empty, sum(U^2) over A_c. RMS(U) never needs U: U^2 = G^2 mean(R) / (R C), so sum(U^2) =
mean(R) * sum_cols(D / C). Vectors sum only their RMS terms (over dp and, for tp-``Shard(0)`` biases, tp);
tensors with > 2 dims are cut along a dim the factors do not span, so only their RMS sums travel. Unsharded the
same formulas run with nothing reduced, so a sharded run equals an unsharded one up to the order of
floating-point sums. A padded vocabulary (rows past the real ones, zero in value and gradient) divides by its
real rows; its padding rows add nothing but their R (<= eps1 each) to sum(R), far below float32 resolution.
:class:`memsave.engines.MemsaveOptimizer` calls :meth:`Adafactor.shard`.

Where this differs from ``torch.optim.Adafactor`` (which follows the paper except as its docs say): torch adds
eps1 as a floor on mean(R) and on V instead of adding it to G^2, and its ``lr`` caps the relative step
(rho_t = min(lr, 1/sqrt(t))) and scales weight decay by that cap. With ``eps=(1e-30, 1e-3)``, no weight decay
and torch's default ``lr=1e-2``, the two compute the same update (tested), up to rounding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch

from memsave.optim.adafactor_shard import Layout, ReduceOver, reduce_grouped, without

__all__ = ["Adafactor"]

Parts = dict[tuple[str, ...], list[torch.Tensor]]  # partial sums to add up over the ranks of each axis set
_ROUNDS = 3  # row sums over the column axes; row-axis sums and the RMS sums; sum(U^2) over the column axes



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
        self._reduce_over: ReduceOver | None = None
        self._layouts: dict[torch.Tensor, Layout] = {}
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
    def shard(self, reduce_over: ReduceOver, layouts: dict[torch.Tensor, Layout]) -> None:
        """Step slices of whole tensors: ``layouts`` gives each stepped tensor the mesh axes that cut its rows, its
        columns and any dim, and its whole shape (:func:`~memsave.optim.adafactor_shard.layout_of`);
        ``reduce_over(flat, axes)`` sums a tensor in place over those axes (see [Note: Adafactor under row
        sharding])."""
        self._reduce_over, self._layouts = reduce_over, dict(layouts)

    def alias(self, view: torch.Tensor, of: torch.Tensor) -> None:
        """Step ``view`` (a tensor sharing ``of``'s elements: offload steps a shard through a view of it) as cut
        like ``of``."""
        if of in self._layouts:
            self._layouts[view] = self._layouts[of]

    def state_is_row_sharded(self, key: str, full_shape: torch.Size) -> bool:
        """Whether state ``key`` of a parameter holds one slice per parameter row (so gathers along dim 0 under
        sharding); ``col_var`` of a 2-D parameter and ``step`` are the same on every rank."""
        if key == "step":
            return False
        return not (key == "col_var" and len(full_shape) == 2)

    def _layout(self, p: torch.Tensor) -> Layout:
        lay = self._layouts.get(p)
        return lay if lay is not None else Layout((), (), (), p.shape)

    def _reduce(self, parts: dict[tuple[str, ...], list[torch.Tensor]]) -> None:
        if self._reduce_over is None or not any(axes and ts for axes, ts in parts.items()):
            return
        start = time.perf_counter()
        reduce_grouped(parts, self._reduce_over)
        self.last_reduce_seconds += time.perf_counter() - start

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
        pending: list[Generator[Parts, None, None]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse or torch.is_complex(p):
                    raise NotImplementedError("Adafactor supports dense real parameters only")
            if not params:
                continue
            if self.foreach:  # runs up to its first reduction; each round is reduced below for every group at once
                pending.append(self._foreach_group(group, params))
            else:
                self._single_group(group, params)
        for _ in range(_ROUNDS):
            merged: Parts = {}
            for steps in pending:
                for axes, tensors in next(steps).items():
                    merged.setdefault(axes, []).extend(tensors)
            self._reduce(merged)
        for steps in pending:
            next(steps, None)
        return loss

    def _foreach_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> Generator[Parts, None, None]:
        """All tensors of a group at once: elementwise work in ``torch._foreach_*`` calls, per-tensor reductions
        along dims, one host sync for every per-tensor scalar. A generator: it yields ``_ROUNDS`` times the partial
        sums to be added over the ranks of each axis set (nothing when not sharded), which :meth:`step` reduces in
        place, for all groups at once, before resuming it."""
        eps1, d, c = group["eps"][0], group["clip_threshold"], group["decay_rate"]
        states = [self._init_state(group, p) for p in params]
        grads: list[torch.Tensor] = [p.grad for p in params if p.grad is not None]
        if group["maximize"]:
            grads = list(torch._foreach_neg(grads))
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        step_values = torch.stack(steps).tolist()
        lays = [self._layout(p) for p in params]
        full = [lay.full_shape for lay in lays]
        g2 = list(torch._foreach_mul(grads, grads))
        factored = [k for k, p in enumerate(params) if p.dim() >= 2]
        vectors = [k for k, p in enumerate(params) if p.dim() < 2]
        one_minus_beta2 = [t**c for t in step_values]
        # round 1: where columns are cut, the row sums of G^2 over the column axes (R must be the whole row's)
        row_means: dict[int, torch.Tensor] = {}
        parts: Parts = {}
        for k in factored:
            if lays[k].cols:
                row_means[k] = g2[k].sum(dim=-1, keepdim=True)
                parts.setdefault(lays[k].cols, []).append(row_means[k])
            else:
                row_means[k] = g2[k].mean(dim=-1, keepdim=True)
        yield parts
        # local statistics; X^2 sums are taken before the update (alpha_t uses RMS(X_{t-1}))
        sq = [n * n for n in torch._foreach_norm(params)] if params else []
        colsums: dict[int, torch.Tensor] = {}
        dsums: dict[int, torch.Tensor] = {}
        rsums: dict[int, torch.Tensor] = {}
        for k in factored:
            st, g = states[k], g2[k]
            if lays[k].cols:
                row_means[k].div_(full[k][-1])
            st["row_var"].lerp_(row_means[k].add_(eps1), one_minus_beta2[k])
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
        # factored tensors with whole rows here: C, mean(R) and the partial sum(U^2) now, without forming U
        mean_rs: dict[int, torch.Tensor] = {}
        for k in factored:
            if not lays[k].rows:
                self._finish_factored(k, states[k], full[k], colsums, rsums, dsums, mean_rs, usq, eps1,
                                      one_minus_beta2[k])
        # round 2: sums over rows held elsewhere (C, mean(R), D), and sum(X^2) and the local sum(U^2) over every
        # axis that cuts the tensor; every partial sum is reduced in place
        sq_t = torch.stack(sq)
        parts = {}
        for k in range(len(params)):
            if lays[k].every:
                parts.setdefault(lays[k].every, []).append(sq_t[k])
                if k in usq:
                    parts.setdefault(lays[k].every, []).append(usq[k])
        for k in factored:
            if lays[k].rows:
                parts.setdefault(lays[k].rows, []).extend([colsums[k], dsums[k], rsums[k]])
        yield parts
        sq = list(sq_t.unbind())
        # round 3: sum(U^2) of tensors whose rows were cut, over the axes cutting them otherwise (their columns)
        parts = {}
        for k in factored:
            if lays[k].rows:
                self._finish_factored(k, states[k], full[k], colsums, rsums, dsums, mean_rs, usq, eps1,
                                      one_minus_beta2[k])
                rest = without(lays[k].every, lays[k].rows)
                if rest:
                    parts.setdefault(rest, []).append(usq[k])
        yield parts
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

    @staticmethod
    def _finish_factored(k: int, st: dict[str, Any], full: torch.Size, colsums: dict[int, torch.Tensor],
                         rsums: dict[int, torch.Tensor], dsums: dict[int, torch.Tensor],
                         mean_rs: dict[int, torch.Tensor], usq: dict[int, torch.Tensor], eps1: float,
                         one_minus_beta2: float) -> None:
        """C, mean(R) and this rank's sum(U^2) of a factored tensor from its (row-complete) column sums:
        U^2 = G^2 mean(R) / (R C), so sum(U^2) = mean(R) sum_cols(D / C)."""
        rows = full[-2]
        st["col_var"].lerp_(colsums[k].div_(rows).add_(eps1), one_minus_beta2)
        mean_rs[k] = rsums[k].div_(rows)
        usq[k] = (mean_rs[k] * dsums[k] / st["col_var"]).sum()

    def _single_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """The plain per-tensor path: the paper's formulas written out literally (V materialized, RMS(U) from
        U), one tensor at a time and up to three reductions per cut tensor. The reference the foreach path is
        tested against."""
        eps1, d, c = group["eps"][0], group["clip_threshold"], group["decay_rate"]
        for p in params:
            st = self._init_state(group, p)
            assert p.grad is not None
            g = -p.grad if group["maximize"] else p.grad
            lay = self._layout(p)
            full = lay.full_shape
            st["step"] += 1
            t = float(st["step"])
            one_minus_beta2 = t**c
            sums = torch.stack([p.square().sum()])
            if p.dim() >= 2:
                row = (g * g).sum(dim=-1, keepdim=True)
                self._reduce({lay.cols: [row]})  # the whole rows' sums where the columns are cut
                st["row_var"].lerp_(row / full[-1] + eps1, one_minus_beta2)
                col = (g * g).sum(dim=-2, keepdim=True)
                r_sum = st["row_var"].sum(dim=-2, keepdim=True)
                self._reduce({lay.rows: [col, r_sum]})  # over the rows other ranks hold
                st["col_var"].lerp_(col / full[-2] + eps1, one_minus_beta2)
                v = st["row_var"] * st["col_var"] / (r_sum / full[-2])
            else:
                st["variance"].lerp_(g * g + eps1, one_minus_beta2)
                v = st["variance"]
            u = g / v.sqrt()
            sums = torch.cat([sums, torch.stack([u.square().sum()])])
            self._reduce({lay.every: [sums]})  # sum(X^2) and sum(U^2) over every slice of the tensor
            numel = math.prod(full) if len(full) else 1
            rho, alpha = self._step_sizes(group, t, math.sqrt(float(sums[0]) / numel))
            u = u / max(1.0, math.sqrt(float(sums[1]) / numel) / d)
            if group["weight_decay"]:
                p.mul_(1.0 - rho * group["weight_decay"])
            u = u * alpha
            if group["beta1"] is not None:
                st["exp_avg"].lerp_(u.to(st["exp_avg"].dtype), 1.0 - group["beta1"])
                u = st["exp_avg"]
            p.sub_(u)
