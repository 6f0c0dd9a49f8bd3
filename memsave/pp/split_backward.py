"""The zero-bubble split of a stage's backward: ``I`` (gradients of the stage's inputs) then ``W`` (of its weights),
each computing its own part once.

[Note: the I/W split] (Qi et al., 2024; the construction of torch's ``pipelining/_backward.py``.) The autograd
graph of a stage runs from its roots (what it sent on, or its loss) back to its inputs (the received tensors) and
its weights (every other leaf: ``AccumulateGrad`` nodes). The nodes reachable from the inputs (forward direction)
form the *input closure*; walking from each weight towards the roots, the first nodes met inside that closure are
its *intermediates* (a ``Linear``'s ``AddmmBackward0``): everything the weight's gradient needs beyond them is in
its own subgraph. ``I`` runs ``autograd.grad`` to the inputs only, keeping the graph, with a pre-hook on every
intermediate that saves the gradient arriving there; ``W`` runs ``autograd.backward`` from the intermediates with
those gradients into the weights only, so a weight's ``AccumulateGrad`` (and the hooks of the engine below:
gradient buckets, ZeRO's reduce-scatter) runs as in a plain backward. Where a weight has more than one
intermediate, each pre-hook returns its saved gradient in ``W``, so a gradient reaching one intermediate through
another is not counted twice. Weights no input reaches (nothing of theirs is in the closure) take their gradient
in ``W`` from the roots; so does a stage without inputs (the first): its ``I`` has nothing to compute.

Before, ``W`` ran the whole backward again from the roots (``I`` + ``W`` about twice a full backward).

[Note: one recomputation per weight pass] Under recomputation torch's checkpoint rebuilds a unit once per autograd
call (per graph task), and ``W`` makes one call per group of weights: a GPT block was rebuilt 7 times per
micro-batch, and each rebuild's unread tensors stayed to the end of the pass (3.4x the stage's activations of one
micro-batch). ``W`` now runs its calls inside one ``torch.utils.checkpoint.GraphExecGroup``: one rebuild per unit
for the whole pass (the calls run disjoint parts of the graph, as the group requires: each group's nodes lie
between its intermediates and its weights), and each rebuild's unread tensors are dropped after the last call that
reads the unit ([Note: regions released in the weight pass] in memsave/recompute/checkpoint.py). ``I`` and ``W``
together rebuild a unit twice per micro-batch; a plain backward once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import GraphExecGroup

from memsave.recompute.checkpoint import RecomputedRegion

__all__ = ["WeightPass", "backward_input"]


@dataclasses.dataclass
class _Group:
    weights: list[torch.Tensor]
    intermediates: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None]
    runs: set[int] = dataclasses.field(default_factory=set)  # sequence numbers of the nodes its W call runs


@dataclasses.dataclass
class WeightPass:
    """What ``I`` left for ``W``: :meth:`run` it once."""

    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor | None]
    groups: list[_Group]
    orphans: list[torch.Tensor]  # weights no input reaches: from the roots
    orphan_runs: set[int] = dataclasses.field(default_factory=set)
    regions: Sequence[RecomputedRegion] = ()  # the recomputed calls of the forward ([Note: regions released ...])

    def run(self, quiet: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        """One autograd backward per group of weights (and one for the orphans); all but the last inside
        ``quiet()``: the engine's ``no_sync``, so a data-parallel engine reduces the gradients once, after the last
        (one reduce per weight pass; under ZeRO-1 a reduce after each call raised, when it refused accumulating)."""
        calls: list[tuple[_Group | None, list[Any], list[Any]]] = []
        runs: list[set[int]] = []
        # in backward order (the latest intermediate first), so a unit's calls come together and each rebuild is
        # released before the next unit's
        for g in sorted(self.groups, key=lambda g: -max(n._sequence_nr() for n in g.intermediates)):
            edges: list[Any] = []
            grads: list[Any] = []
            for node, got in zip(g.intermediates, g.grads):
                for i, grad in enumerate(got or ()):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
            if edges:
                calls.append((g, edges, grads))
                runs.append(g.runs)
        if self.orphans and self.roots:
            calls.append((None, list(self.roots), list(self.root_grads)))
            runs.append(self.orphan_runs)
        # after which call each recomputed region is read no more: the last whose nodes fall in its range
        done: dict[int, list[RecomputedRegion]] = collections.defaultdict(list)
        for region in self.regions:
            last = max((k for k, seqs in enumerate(runs) if any(region.start <= q < region.end for q in seqs)),
                       default=-1)
            done[last].append(region)
        with GraphExecGroup() as exec_group:  # [Note: one recomputation per weight pass]
            def release(k: int) -> None:
                for region in done.get(k, ()):
                    region.release(exec_group)

            self._backward(calls, quiet, release)
        self.groups.clear()
        self.roots.clear()
        self.regions = ()

    def _backward(self, calls: list[tuple[_Group | None, list[Any], list[Any]]],
                  quiet: Callable[[], contextlib.AbstractContextManager[Any]], after: Callable[[int], Any]) -> None:
        for k, (group, edges, grads) in enumerate(calls):
            with quiet() if k + 1 < len(calls) else contextlib.nullcontext():
                if group is None:
                    torch.autograd.backward(edges, grads, retain_graph=True, inputs=self.orphans)
                else:
                    self._group_backward(group, edges, grads)
            after(k)

    @staticmethod
    def _group_backward(group: _Group, edges: list[Any], grads: list[Any]) -> None:
        handles = []
        if len(group.intermediates) > 1:  # each intermediate takes exactly what it got in I
            handles = [node.register_prehook(lambda _, saved=got: saved)
                       for node, got in zip(group.intermediates, group.grads)]
        try:
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.weights)
        finally:
            for h in handles:
                h.remove()


def _variable(node: Node) -> torch.Tensor:
    """The leaf tensor an ``AccumulateGrad`` node accumulates into."""
    return node.variable  # type: ignore[attr-defined,no-any-return]


def _leaf_node(t: torch.Tensor) -> Node | None:
    if t.grad_fn is not None:
        return t.grad_fn
    view = t.view_as(t)
    return view.grad_fn.next_functions[0][0] if view.grad_fn is not None else None


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes whose backward feeds it (the reverse edges), for every node reachable from ``roots``."""
    out: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    q = collections.deque(roots)
    while q:
        node = q.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            out[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                q.append(nxt)
    return out


def _closure(start: Sequence[Node], stop: set[Node], consumers: dict[Node, list[Node]]) -> tuple[set[Node], set[Node]]:
    """(nodes reached from ``start`` along consumer edges, not entering ``stop``; the ``stop`` nodes met)."""
    seen, met = set(start), set()
    q = collections.deque(start)
    while q:
        for c in consumers.get(q.popleft(), ()):
            if c in seen:
                continue
            if c in stop:
                met.add(c)
                continue
            seen.add(c)
            q.append(c)
    return seen, met


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
                   regions: Sequence[RecomputedRegion] = ()) -> tuple[list[torch.Tensor | None], WeightPass]:
    """``I`` ([Note: the I/W split]): the gradients of ``inputs``, and what ``W`` needs to finish. ``regions``: the
    recomputed calls of the forward, released by ``W`` once read ([Note: regions released in the weight pass] in
    memsave/recompute/checkpoint.py)."""
    root_nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
    consumers = _consumers(root_nodes)
    input_ids = {id(t) for t in inputs}
    input_nodes = [n for n in (_leaf_node(t) for t in inputs) if n is not None]
    weights = [n for n in consumers if type(n).__name__ == "AccumulateGrad"
               and id(_variable(n)) not in input_ids and _variable(n).requires_grad]
    if not roots or not inputs or not input_nodes:  # one call from the roots: it reads every region
        return [None] * len(inputs), WeightPass(roots, grads, [], [_variable(n) for n in weights],
                                                {r.start for r in regions}, regions)
    closure, _ = _closure(input_nodes, set(), consumers)
    groups: dict[Node, _Group] = {}
    orphans: list[torch.Tensor] = []
    orphan_runs: set[int] = set()
    for w in weights:
        seen, met = _closure([w], closure, consumers)
        if not met:
            orphans.append(_variable(w))
            if regions:  # only a recomputed forward has regions to release
                orphan_runs.update(n._sequence_nr() for n in seen)
            continue
        found = list({id(groups[n]): groups[n] for n in met if n in groups}.values())
        group = found[0] if found else _Group([], [], [])
        if regions:
            group.runs.update(n._sequence_nr() for n in seen | met)
        for other in found[1:]:  # one weight joins two groups: they become one
            group.weights += other.weights
            group.runs |= other.runs
            for n in other.intermediates:
                group.intermediates.append(n)
                group.grads.append(None)
                groups[n] = group
        group.weights.append(_variable(w))
        for n in met:
            if n not in group.intermediates:
                group.intermediates.append(n)
                group.grads.append(None)
            groups[n] = group
    unique = list({id(g): g for g in groups.values()}.values())
    handles = []

    def saver(group: _Group, i: int) -> Any:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            group.grads[i] = grad_outputs
        return hook

    try:
        for g in unique:
            for i, node in enumerate(g.intermediates):
                handles.append(node.register_prehook(saver(g, i)))
        got = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return list(got), WeightPass(roots, grads, unique, orphans, orphan_runs, regions)
