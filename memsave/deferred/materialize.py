"""Materializing a meta-device model a few tensors at a time: what ``memsave.wrap`` does with a deferred model.

[Note: materialization] ``wrap`` builds one :class:`Materializer` before it changes anything: it finds the model's
meta parameters and buffers, the recorded programs that created them ([Note: deferred-init recording] in
record.py), and, for a tensor nothing recorded writes (a model built under plain ``torch.device("meta")``, or a
module whose ``__init__`` leaves it empty), it traces ``init_fn(module)`` or ``module.reset_parameters()`` of the
modules that hold such tensors, children first ([Note: inits as model.apply runs them]), from the RNG as it is at
wrap. A tensor still unwritten is a
``ValueError`` naming it, its module and the ways out, raised before anything is materialized. Then each call of
:meth:`Materializer.materialize` replays what writes the given tensors, on the CPU (so random draws equal an eager
construction's on the CPU), casts and moves them, and swaps the real values into the meta tensors' Python objects
(``torch.utils.swap_tensors``): the model's modules, tied slots and the optimizer's param groups keep the very
objects they held, now real.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from memsave.deferred.record import Program, Ref, programs, recording, release, storage_key
from memsave.deferred.replay import replay

__all__ = ["Materializer", "has_meta", "meta_tensors"]

InitFn = Callable[[nn.Module], None]


def meta_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` of every meta parameter then buffer of ``model``, a shared one once."""
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta" and id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def has_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """For each tensor (by id), the modules holding it directly, in module order."""
    out: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, m in model.named_modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None:
                out.setdefault(id(t), []).append((mname, m))
    return out


def _post_order(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` once, children before their parent (``nn.Module.apply``'s order)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out


class Materializer:
    """The meta tensors of one model and how to compute each ([Note: materialization])."""

    def __init__(self, model: nn.Module, init_fn: InitFn | None = None) -> None:
        if init_fn is not None and not callable(init_fn):
            raise ValueError(f"init_fn={init_fn!r} is not callable; pass a function of one module, e.g. "
                             "model._init_weights for a Hugging Face model")
        self.model = model
        self.tensors = meta_tensors(model)
        for name, t in self.tensors:
            if type(t) not in (torch.Tensor, nn.Parameter):
                raise NotImplementedError(
                    f"memsave.wrap: {name!r} is a meta tensor of class {type(t).__name__}; deferred initialization "
                    "materializes plain nn.Parameter and torch.Tensor only: build that module eagerly")
        loose = [f"{mname}.{k}" if mname else k for mname, m in model.named_modules()
                 for k, v in vars(m).items() if isinstance(v, torch.Tensor) and v.device.type == "meta"]
        if loose:  # not a parameter or buffer: nothing would make it real, and the forward fails in torch's words
            raise ValueError(
                f"memsave.wrap: {loose[:3]} {'is a meta tensor' if len(loose) == 1 else 'are meta tensors'} kept as "
                "a plain module attribute, which deferred initialization does not materialize; register it as a "
                "buffer (self.register_buffer(name, tensor, persistent=False)) so it is made real with the model")
        keys = {storage_key(t) for _, t in self.tensors}
        self.programs = [p for p in programs() if p.known & keys]
        created = {k for p in self.programs for k in p.known - p.external.keys()}
        self.external: dict[int, Ref] = {k: r for p in self.programs for k, r in p.external.items()
                                         if k not in created}
        for _, t in self.tensors:
            if storage_key(t) not in created:
                self.external.setdefault(storage_key(t), Ref.of(t))
        self.ops = [op for p in self.programs for op in p.ops]
        gens = {id(op.rng[0]): op.rng[0] for op in self.ops if op.rng is not None}
        gens[id(torch.default_generator)] = torch.default_generator
        before = [(g, g.get_state()) for g in gens.values()]
        try:
            self._trace_inits(model, init_fn)
        except BaseException:
            for g, state in before:  # a refused wrap draws nothing
                g.set_state(state)
            raise
        # the RNG after wrap is where it was at wrap (after the traced inits, which stand for an eager construction)
        self._generators = [(g, g.get_state()) for g in gens.values()]

    def _trace_inits(self, model: nn.Module, init_fn: InitFn | None) -> None:
        """[Note: inits as model.apply runs them] ``init_fn`` (or else ``reset_parameters``) is traced for every
        module whose subtree holds a tensor nothing recorded writes and no real tensor, children before their
        parent, as ``model.apply(init_fn)`` (and Hugging Face's ``smart_apply``) runs it and as eager construction
        leaves a parent's init after its children's. Only modules owning such a tensor were called before, parents
        first: GPT-2's ``_init_weights`` of the attention and MLP (which owns no tensor and rescales ``c_proj``)
        never ran, and a parent's ``reset_parameters`` was overwritten by its child's (std 0.020 for 0.010)."""
        done = {k for op in self.ops if not op.alloc for k in op.writes}
        todo = {id(t) for _, t in self.tensors if storage_key(t) not in done}
        if not todo:
            return
        self._refuse_unrecorded(init_fn)
        owners = _owners(model)
        extra = Program()
        with recording(extra):
            for m in _post_order(model):
                held = [*m.parameters(), *m.buffers()]
                if not any(id(t) in todo for t in held) or any(t.device.type != "meta" for t in held):
                    continue
                reset = getattr(m, "reset_parameters", None)
                if init_fn is not None:
                    init_fn(m)
                elif callable(reset):
                    reset()
        self.ops.extend(extra.ops)
        for k, r in extra.external.items():
            if k not in self.external and not any(k in p.known for p in self.programs):
                self.external[k] = r
        done |= extra.initialized()
        missing = [(n, t) for n, t in self.tensors if storage_key(t) not in done]
        if missing:
            name, t = missing[0]
            mname, m = owners.get(id(t), [("", model)])[0]
            kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
            how = ("init_fn, applied to every module children first, did not write it" if init_fn is not None else
                   f"{type(m).__name__}.reset_parameters() does not write it and no init_fn= was given"
                   if callable(getattr(m, "reset_parameters", None)) else
                   f"{type(m).__name__} has no reset_parameters() and no init_fn= was given")
            others = f" (and {len(missing) - 1} more: {[n for n, _ in missing[1:4]]})" if len(missing) > 1 else ""
            raise ValueError(
                f"memsave.wrap: {kind} {name!r} of module {mname or '<root>'!r} ({type(m).__name__}) is on the meta "
                f"device and nothing initializes it{others}: it was not written under memsave.deferred_init(), and "
                f"{how}. Build the model under memsave.deferred_init() with an __init__ that initializes it, give "
                f"{type(m).__name__} a reset_parameters() that writes it, or pass wrap(..., init_fn=fn) with "
                "fn(module) writing it"
            )

    def _refuse_unrecorded(self, init_fn: InitFn | None) -> None:
        """A model built under ``deferred_init()`` holding meta tensors that no recording knows: made outside the
        block (PEFT's ``get_peft_model`` after it), so what their ``__init__`` did (LoRA's zero B) was not seen.
        Initializing them by ``reset_parameters`` gave LoRA's B random values: the adapted model no longer started
        at the base model. Refused by name unless ``init_fn`` says how."""
        if not self.programs or init_fn is not None:
            return
        known = {k for p in self.programs for k in p.known}
        outside = [n for n, t in self.tensors if storage_key(t) not in known]
        if outside:
            raise ValueError(
                f"memsave.wrap: {len(outside)} meta tensor(s) were made outside memsave.deferred_init(), e.g. "
                f"{outside[:3]}, so how their modules initialized them (an adapter's zeros) was not recorded; "
                "create them inside the block too (with memsave.deferred_init(): model = get_peft_model(model, ...)), "
                "or pass wrap(..., init_fn=fn) to initialize them")

    @torch.no_grad()
    def materialize(self, tensors: Sequence[torch.Tensor], *, device: torch.device,
                    dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Compute ``tensors`` (meta ones; others are skipped) on the CPU, cast floating-point parameters to
        ``dtype``, move them to ``device`` and swap the values into the same Python objects; returns them."""
        todo, seen = [], set()
        for t in tensors:
            if t.device.type == "meta" and id(t) not in seen:
                seen.add(id(t))
                todo.append(t)
        if not todo:
            return []
        cpu = torch.device("cpu")
        storages = replay(self.ops, {storage_key(t) for t in todo}, self.external, cpu)
        for t in todo:
            ref = Ref.of(t)
            real = torch.empty(0, dtype=ref.dtype, device=cpu).set_(storages[ref.key], ref.offset, ref.size,
                                                                    ref.stride)
            is_param = isinstance(t, nn.Parameter)
            if is_param and dtype is not None and real.is_floating_point():
                real = real.to(dtype)
            real = real.to(device)
            new = nn.Parameter(real, requires_grad=t.requires_grad) if is_param else real
            new.__dict__.update(t.__dict__)  # (attributes set on the tensor, e.g. Hugging Face's _is_hf_initialized)
            torch.utils.swap_tensors(t, new)
        return todo

    def finish(self) -> None:
        """Restore the generators; once the model holds no meta tensor (a pipeline stage drops the others'), forget
        the recorded programs."""
        for g, state in self._generators:
            g.set_state(state)
        if not has_meta(self.model):
            for p in self.programs:
                release(p)
