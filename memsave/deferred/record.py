"""Recording what a model's construction does to its meta tensors, so that it can be replayed unit by unit.

[Note: deferred-init recording] Under :func:`deferred_init` every factory call lands on the meta device (no
memory), and a ``TorchDispatchMode`` logs each aten operation that touches a meta tensor: the operation, its
arguments (a meta tensor is kept as a :class:`Ref`: its storage, dtype, size, stride and offset; any other value,
a CPU tensor included, as is), which storages it reads and which it writes. A meta tensor has no values, so the
construction code cannot branch on them (``.item()`` raises): the log is a straight-line program, and replaying
the operations that write a tensor's storage (and, transitively, what they read) on real memory computes that
tensor exactly as eager construction would have.

Random operations (``torch.Tag.nondeterministic_seeded``: ``uniform_``, ``normal_``, ``randn``, ...) draw
nothing on meta tensors, so an eager construction and a meta one would leave the RNG in different states and
every later draw would differ. The recorder therefore runs each random operation a second time on a scratch CPU
tensor of the same size, dtype and strides (one tensor at a time, freed at once), so it consumes exactly what
eager construction consumes, and it keeps the generator's state from just before. Replaying the operation with
that state reproduces the eager values wherever and whenever it runs: a unit can be materialized at wrap, in
any order, with nothing but its own operations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from memsave.dist.host_memory import trim_host_memory

__all__ = ["Op", "Program", "Recorder", "Ref", "deferred_init", "programs", "recording", "release", "storage_key"]

aten = torch.ops.aten
# operations that only allocate: a storage written by nothing else is uninitialized
_ALLOCATIONS = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views and ``nn.Parameter`` wrappers share it)."""
    return t.untyped_storage()._cdata


@dataclasses.dataclass(frozen=True)
class Ref:
    """A meta tensor in the log: a view of storage ``key``."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int  # of the whole storage

    @staticmethod
    def of(t: torch.Tensor) -> Ref:
        return Ref(storage_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()),
                   t.untyped_storage().nbytes())


class _MetaDevice:
    """Stands for ``torch.device("meta")`` in a logged call; replayed as the target device."""


META_DEVICE = _MetaDevice()


@dataclasses.dataclass
class Op:
    """One logged aten call, or one whole call of a value-dependent ``nn.init`` function ([Note: value-dependent
    inits])."""

    func: Any  # an OpOverload, or the original nn.init function
    args: Any  # pytree with Ref / META_DEVICE leaves
    kwargs: Any
    reads: frozenset[int]  # storages of every meta tensor argument
    writes: frozenset[int]  # storages it mutates or creates
    creates: tuple[tuple[int, Ref], ...]  # (index among the flattened outputs, the new storage)
    rng: tuple[torch.Generator, torch.Tensor] | None  # the generator and its state just before (random ops)
    alloc: bool  # only allocates (empty, empty_like, ...)


class Program:
    """The log of one :func:`deferred_init` block (or of the inits ``wrap`` traced itself)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.known: set[int] = set()  # storages created inside, or first seen as arguments (``external``)
        self.external: dict[int, Ref] = {}  # storages that existed before the log began
        self._alive: list[torch.UntypedStorage] = []  # keep every logged storage alive: keys stay unique

    def _see(self, t: torch.Tensor, *, created: bool) -> int:
        key = storage_key(t)
        if key not in self.known:
            self.known.add(key)
            self._alive.append(t.untyped_storage())
            if not created:
                self.external[key] = Ref.of(t)
        return key

    def initialized(self) -> set[int]:
        """Storages some operation other than an allocation writes."""
        return {k for op in self.ops if not op.alloc for k in op.writes}


# [Note: scratch draws and the heap] A scratch tensor is freed at once, but the small allocations that outlive it
# (the generator state kept, the meta tensors' own structures) land above it in glibc's heap, which then cannot
# shrink: measured on a 24 MiB GPT, the construction kept 40 MiB of freed heap. Past this size a scratch draw is
# followed by malloc_trim, so the construction's RSS stays at one scratch tensor above what is live.
_TRIM_BYTES = 1 << 20


def _after_scratch(nbytes: int) -> None:
    if nbytes >= _TRIM_BYTES:
        trim_host_memory()


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if i < len(args) and not arg.kwarg_only:
                out.append(args[i])
            elif arg.name in kwargs:
                out.append(kwargs[arg.name])
    return out


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _scratch(x: Any, written: set[int]) -> Any:
    """A CPU stand-in for a meta argument of a random op: same size, dtype and strides for what it writes (its
    kernel's path, and so its draws, depend on them), zeros for what it reads (a valid mean, std or p)."""
    if _is_meta(x):
        if id(x) in written:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
        return torch.zeros(x.shape, dtype=x.dtype, device="cpu")
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


class Recorder(TorchDispatchMode):
    """Logs into ``program`` every aten call that touches a meta tensor ([Note: deferred-init recording])."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        meta_in = [x for x in leaves if _is_meta(x)]
        to_meta = any(isinstance(x, torch.device) and x.type == "meta" for x in leaves)
        rng = None
        if (meta_in or to_meta) and torch.Tag.nondeterministic_seeded in func.tags:
            gen = kwargs.get("generator") or torch.default_generator
            rng = (gen, gen.get_state())
            written = {id(x) for x in _written_args(func, args, kwargs)}
            scratch = tree_map(lambda x: _scratch(x, written), (args, kwargs))
            func(*scratch[0], **scratch[1])  # consume what eager construction consumes; values dropped
            nbytes = sum(x.nbytes for x in tree_flatten(scratch)[0] if isinstance(x, torch.Tensor))
            del scratch
            _after_scratch(nbytes)  # [Note: scratch draws and the heap]
        out = func(*args, **kwargs)
        outs = [x for x in tree_flatten(out)[0]]
        if not meta_in and not any(_is_meta(x) for x in outs):
            return out
        p = self.program
        reads = frozenset(p._see(x, created=False) for x in meta_in)
        writes = {storage_key(x) for x in _written_args(func, args, kwargs) if _is_meta(x)}
        creates = []
        for i, x in enumerate(outs):
            if _is_meta(x) and storage_key(x) not in p.known:
                creates.append((i, Ref.of(x)))
                writes.add(p._see(x, created=True))

        def spec(x: Any) -> Any:
            if _is_meta(x):
                return Ref.of(x)
            if isinstance(x, torch.device) and x.type == "meta":
                return META_DEVICE
            return x

        p.ops.append(Op(func, tree_map(spec, args), tree_map(spec, kwargs), reads, frozenset(writes),
                        tuple(creates), rng, func.overloadpacket in _ALLOCATIONS))
        return out


# [Note: value-dependent inits] torch.nn.init functions that return at once on a meta tensor (their eager form
# branches on the values drawn: trunc_normal_'s rejection loop, orthogonal_'s QR signs), so the dispatch log would
# see nothing. While recording they are replaced, as module attributes, by a wrapper that logs the whole call as one
# operation on its tensor and runs it on a scratch tensor to consume the RNG; the replay calls the original on the
# real tensor from the same generator state, and so draws the same values through the same branches. A copy bound
# before the block (``from torch.nn.init import orthogonal_``) is not replaced; trunc_normal_ is covered through
# its helper, which it looks up at each call.
_VALUE_DEPENDENT = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _logged_init(program: Program, original: Any) -> Any:
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not _is_meta(tensor):
            return original(tensor, *args, **kwargs)
        gen = kwargs.get("generator") or torch.default_generator
        state = gen.get_state()
        original(torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu"), *args,
                 **kwargs)  # consume what eager construction consumes
        _after_scratch(tensor.nbytes)
        key = program._see(tensor, created=False)
        program.ops.append(Op(original, (Ref.of(tensor), *args), dict(kwargs), frozenset({key}), frozenset({key}),
                              (), (gen, state), False))
        return tensor
    return init


@contextlib.contextmanager
def recording(program: Program) -> Iterator[Program]:
    """Log into ``program`` what runs on meta tensors inside the block ([Note: deferred-init recording])."""
    saved = {name: getattr(torch.nn.init, name) for name in _VALUE_DEPENDENT}
    for name, original in saved.items():
        setattr(torch.nn.init, name, _logged_init(program, original))
    try:
        with Recorder(program):
            yield program
    finally:
        for name, original in saved.items():
            setattr(torch.nn.init, name, original)


_META = torch.device("meta")
# built from data the caller holds: left on the CPU (they hold their values already)
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


class MetaFactories(TorchFunctionMode):
    """Tensor factories default to the meta device, as under ``torch.device("meta")``, except those built from data.

    [Note: not a device context] ``torch.device("meta")`` makes ``torch.tensor([]).device`` meta, which is how
    Hugging Face's ``init_weights`` tells a meta-device construction and then *skips* ``_init_weights`` (pointless
    without recording): its values would then differ from an eager construction's. Under this mode the default
    device stays the CPU and data-built tensors stay there, so the model's own init runs and is recorded.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _device_constructors() and func not in _FROM_DATA and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


_PROGRAMS: list[Program] = []


def programs() -> list[Program]:
    """The recorded programs no ``wrap`` has consumed yet, oldest first."""
    return list(_PROGRAMS)


def release(program: Program) -> None:
    """Forget ``program`` (``wrap`` calls it once every tensor it recorded is materialized)."""
    if any(p is program for p in _PROGRAMS):
        _PROGRAMS.remove(program)


@contextlib.contextmanager
def deferred_init() -> Iterator[Program]:
    """Build a model without memory, for :func:`memsave.wrap` to materialize unit by unit.

    Inside the block, tensors are created on the meta device (as under ``torch.device("meta")``, except those built
    from data, ``torch.tensor(...)``: [Note: not a device context]) and every
    operation on them is recorded ([Note: deferred-init recording]): the layers' ``reset_parameters`` at
    construction, the model's own init (``model.apply(fn)``, ``nn.init.*``, a loop over projections), buffers
    computed in ``__init__`` (position ids, rotary ``inv_freq``), ties. ``wrap`` replays, per unit, what wrote
    that unit's tensors, and the values equal those of an eager construction from the same RNG state::

        with memsave.deferred_init():
            model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # over the meta parameters
        model, optimizer = memsave.wrap(model, optimizer, "zero3")

    Random draws cost as much as in eager construction (each runs once on a scratch tensor, one at a time), so
    the RNG leaves the block where eager construction would leave it.
    """
    program = Program()
    _PROGRAMS.append(program)
    try:
        with MetaFactories(), recording(program), _no_loading():
            yield program
    except BaseException as exc:
        release(program)  # nothing built in the block will be wrapped
        where = _loader_in(exc.__traceback__)
        if where is not None and isinstance(exc, Exception):
            raise NotImplementedError(
                f"memsave.deferred_init: {where} failed inside the block ({type(exc).__name__}: {exc}). Loading a "
                f"checkpoint inside deferred_init() is not supported: {_LOAD_INSTEAD}") from exc
        raise


_LOAD_INSTEAD = ("build the model from its config inside the block (model = AutoModelForCausalLM.from_config(config)), "
                 "then wrap it and stream the weights with memsave.load_weights(model, folder)")


@contextlib.contextmanager
def _no_loading() -> Iterator[None]:
    """Hugging Face's ``from_pretrained`` is refused inside the block: some models (GPT-2) would load their weights
    eagerly, so the block would silently save nothing, others (Llama) fail on a meta buffer."""
    hf = sys.modules.get("transformers.modeling_utils")
    model_cls = getattr(hf, "PreTrainedModel", None)
    if model_cls is None:  # not imported yet: a failure inside the block is still named (_loader_in)
        yield
        return
    original = model_cls.__dict__["from_pretrained"]

    def refused(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"memsave.deferred_init: {cls.__name__}.from_pretrained inside the block is not supported (it loads the "
            f"weights eagerly, so nothing would be deferred, or fails on the meta tensors): {_LOAD_INSTEAD}")

    model_cls.from_pretrained = classmethod(refused)
    try:
        yield
    finally:
        model_cls.from_pretrained = original


def _loader_in(tb: Any) -> str | None:
    """The Hugging Face loading call a traceback passes through (``from_pretrained``), if any."""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "from_pretrained" and "transformers" in code.co_filename:
            return f"{tb.tb_frame.f_locals.get('cls', type(None)).__name__}.from_pretrained"
        tb = tb.tb_next
    return None
