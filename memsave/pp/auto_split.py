"""``[parallel] balance``: where the stages begin, chosen from each block's parameters or measured time.

:func:`choose_split` gives the names :func:`memsave.pp.split.plan_split` takes as ``split``: the blocks of the
model's layer list ([Note: atoms] in memsave/pp/split.py), each costed by its parameter count (``"params"``) or by
its forward and backward time on one micro-batch (``"time"``, torchgpipe's ``balance_by_time``: forward pre- and
post-hooks and full-backward pre- and post-hooks on each block, the median of three runs after a warm-up), cut
by :func:`memsave.pp.balance` (exact min-max). The modules beside the blocks stay where the split puts them
(before the first block: the first stage; after the last: the last stage), so their cost is added to the first
and last block. Every rank measures, and rank 0's figures decide, so all ranks cut alike.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memsave import dist as mdist
from memsave.pp.balance import Balance, balance
from memsave.pp.split import _atoms, _layer_list

__all__ = ["block_times", "choose_split"]


def _run(model: nn.Module, batch: Any) -> torch.Tensor:
    out = batch(model) if callable(batch) else model(**batch) if isinstance(batch, Mapping) else (
        model(*batch) if isinstance(batch, tuple | list) else model(batch))
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, tuple | list) else out
        if isinstance(loss, torch.Tensor) and loss.dim():
            loss = loss.float().pow(2).mean()
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"[parallel] balance = \"time\": the forward of {type(model).__name__} on example_inputs "
                         f"returned {type(out).__name__}, with no .loss and no tensor to take one from")
    return loss


def block_times(model: nn.Module, names: list[str], batch: Any, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each module in ``names`` on ``batch`` (the median of ``repeats`` runs
    after one warm-up); the gradients it makes are dropped. A forward is timed from its pre-hook to its hook; a
    backward from the module's backward pre-hook to the next one that fires (or to the end of the backward), so the
    first module's backward is counted too, whose input needs no gradient."""
    modules = [model.get_submodule(n) for n in names]
    spent: list[list[float]] = [[0.0] * len(names) for _ in range(repeats + 1)]
    run = [0]
    started: dict[int, float] = {}
    backward: list[tuple[int, float]] = []  # (module, time its backward began), in backward order
    handles = []

    def forward_pre(i: int) -> Callable[..., None]:
        def pre(*_: Any) -> None:
            started[i] = time.perf_counter()
        return pre

    def forward_post(i: int) -> Callable[..., None]:
        def post(*_: Any) -> None:
            spent[run[0]][i] += time.perf_counter() - started.pop(i)
        return post

    def backward_pre(i: int) -> Callable[..., None]:
        def pre(*_: Any) -> None:
            backward.append((i, time.perf_counter()))
        return pre

    for i, m in enumerate(modules):
        handles += [m.register_forward_pre_hook(forward_pre(i)), m.register_forward_hook(forward_post(i)),
                    m.register_full_backward_pre_hook(backward_pre(i))]
    # measuring must not change training: the random streams (dropout) and the buffers (running statistics)
    # are as they were before it
    kept = {name: b.detach().clone() for name, b in model.named_buffers()}
    gpus = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=gpus):
            for r in range(repeats + 1):
                run[0] = r
                backward.clear()
                with warnings.catch_warnings():  # the first block's input needs no gradient: its hook still fires
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    _run(model, batch).backward()
                end = time.perf_counter()
                for (i, t0), (_, t1) in zip(backward, [*backward[1:], (-1, end)]):
                    spent[r][i] += t1 - t0
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(kept[name])
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return [statistics.median(spent[r][i] for r in range(1, repeats + 1)) for i in range(len(names))]


def choose_split(model: nn.Module, n_stages: int, how: str, example_inputs: Any = None) -> tuple[list[str], Balance]:
    """(the block names where stages 1 .. n-1 begin, the :class:`Balance` chosen) under ``balance = how``."""
    owner, _rule = _layer_list(model)
    atoms, blocks = _atoms(model, owner)
    if len(blocks) < n_stages:
        raise ValueError(f"cannot split {type(model).__name__} into {n_stages} pipeline stages: its layer list "
                         f"{owner or '<root>'!r} has {len(blocks)} blocks with parameters")
    nbytes = [sum(p.numel() * p.element_size() for p in model.get_submodule(a).parameters()) for a in atoms]
    if how == "params":
        cost = [float(b) for b in nbytes]
    elif how == "time":
        if example_inputs is None:
            raise ValueError('[parallel] balance = "time" measures each block on one micro-batch: pass '
                             "example_inputs= (one batch like the training ones) to memsave.wrap")
        cost = mdist.all_gather_object(block_times(model, atoms, example_inputs))[0]  # rank 0's figures
    else:
        raise ValueError(f"[parallel] balance = {how!r} is not allowed; expected count, params or time")
    first, last = atoms.index(blocks[0]), atoms.index(blocks[-1])
    block_cost = [cost[atoms.index(b)] for b in blocks]
    block_bytes = [nbytes[atoms.index(b)] for b in blocks]
    block_cost[0] += sum(cost[:first])
    block_cost[-1] += sum(cost[last + 1:])
    block_bytes[0] += sum(nbytes[:first])
    block_bytes[-1] += sum(nbytes[last + 1:])
    chosen = balance(blocks, block_cost, n_stages, nbytes=block_bytes)
    return [blocks[b] for b in chosen.bounds[1:]], chosen
