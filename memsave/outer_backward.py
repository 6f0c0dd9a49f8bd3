"""The end of the user's backward, for the engines' gradient synchronization.

[Note: one sync per outer backward] The data-parallel engines (memsave/engines/dp.py, memsave/zero/engine.py)
synchronize gradients once per backward, in a callback queued on the autograd engine at the first gradient hook.
A callback runs when the *graph task* it was queued on ends. A reentrant checkpoint
(``torch.utils.checkpoint(..., use_reentrant=True)``, Hugging Face's ``gradient_checkpointing_enable()`` in many
versions) runs its region's backward as a nested graph task inside the user's. Where the first gradient of a
backward arrives inside such a region (frozen embeddings and a LoRA model, a parameter shared by several regions),
the callback ran at the end of that region's backward: the synchronization ran once per region (3x the
collectives on three layers), before the gradients of the parameters outside the regions existed, and at
ZeRO-3 freed the root unit in the middle of the backward.

So the root module's forward hooks its outputs: the gradient of an output arrives first in the user's backward,
in its own graph task, and queues the end-of-backward callback there (:meth:`OuterBackward.on_output_grad`).
A gradient hook then asks for the synchronization (:meth:`OuterBackward.request`), which that callback runs. A
backward that reaches no hooked output (a loss the model did not return) queues the synchronization on its own
graph task, as before. The outer callback only runs a synchronization a gradient hook asked for, so an
``autograd.grad`` through the outputs (a gradient penalty) synchronizes nothing.

[Note: a backward that raised] A backward that raises (an out-of-memory error, a custom function's backward)
never reaches its end-of-backward callback. The loop that catches it (``except RuntimeError: zero_grad();
continue``) runs a forward next, outside any backward: there the outer callback is forgotten
(:meth:`OuterBackward.forget`) and each engine drops the backward's half-done state (the parameters already
counted, the reduces launched, which it waits for, and at ZeRO-3 the units gathered). Before, the next backward
found its parameters "already counted" and raised a false reentrant-checkpoint error, every step from then on.
Every rank must raise alike (the same bad batch); where one rank alone raised, its peers wait in that backward's
collectives and end with the collective's error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memsave.models.units import output_tensors

__all__ = ["OuterBackward", "grad_hooks_last", "repeated_gradient_error"]


def _queue(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class OuterBackward:
    """Runs an engine's ``sync`` at the end of the outermost backward that reached the root's outputs."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._task: int | None = None  # the graph task an end-of-backward callback is queued on
        self._asked = False

    def register(self, model: nn.Module) -> list[Any]:
        eager = torch.compiler.disable  # (under torch.compile: run, not traced)
        return [model.register_forward_pre_hook(eager(lambda *_: self.forget())),
                model.register_forward_hook(eager(self._hook_outputs))]

    def forget(self) -> None:
        """A forward outside any backward: a callback still recorded was dropped with a backward that raised (a
        forward recomputed inside the backward, a checkpoint of the whole model, keeps it)."""
        if torch._C._current_graph_task_id() == -1:
            self._task, self._asked = None, False

    def _hook_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in output_tensors(output):
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(self.on_output_grad)

    def on_output_grad(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if self._task != task:  # the first output this backward reached
            self._task, self._asked = task, False
            _queue(self._end)

    def _end(self) -> None:
        asked, self._task, self._asked = self._asked, None, False
        if asked:
            self._sync()

    def request(self) -> None:
        """The first gradient hook of a backward: synchronize at the end of the outer backward when one is under
        way, else at the end of the backward running now."""
        if self._task is not None:
            self._asked = True
        else:
            _queue(self._sync)


def repeated_gradient_error(name: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"memsave: parameter {name!r} received a second gradient in one backward after its {what} was launched: it "
        "is used in several reentrant checkpoints (torch.utils.checkpoint(..., use_reentrant=True), or Hugging "
        "Face's gradient_checkpointing_enable() on a model that shares a layer), each of which runs a backward "
        "of its own. Use non-reentrant checkpoints: use_reentrant=False, or gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False}), or memsave's [recompute] policy")


def grad_hooks_last(handles: list[Any]) -> None:
    """[Note: the user's gradient hooks first] An engine's post-accumulate-grad hook reduces a parameter's
    gradient (ddp: divides its bucket and launches the all-reduce; ZeRO-2/3: reduce-scatters it and drops
    ``p.grad``). Registered at wrap, it ran before every hook the user registered afterwards, which then saw the
    bucket already divided by the world size while its all-reduce ran (a per-layer norm log 2x off; an in-place
    clamp raced the collective) or ``p.grad is None`` (a review). As under torch's DDP, whose reducer runs after
    a parameter's post-accumulate-grad hooks, the user's hooks see this rank's gradient first: before each forward
    the engine puts memsave's hooks (its own, the memory tracker's) after the others on each parameter that has
    others, in their order (a parameter's hooks as ordered last time are not looked at again: under 1 us a
    parameter). The dict is rebuilt: autograd walks it in the underlying dict's order, which
    ``OrderedDict.move_to_end`` leaves as it was."""
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is None or len(hooks) < 2:
            continue
        seen = (len(hooks), next(reversed(hooks)))  # as ordered last time: a hook added since comes last
        if getattr(handle, "_memsave_ordered", None) == seen:
            continue
        items = list(hooks.items())
        ours = [kv for kv in items if str(getattr(kv[1], "__module__", "")).startswith("memsave.")]
        order = [kv for kv in items if kv not in ours] + ours
        if order != items:
            hooks.clear()
            hooks.update(order)
        handle._memsave_ordered = (len(hooks), next(reversed(hooks)))
