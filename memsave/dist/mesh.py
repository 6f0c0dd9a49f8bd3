"""The parallel layout: one explicit object with validated degrees and named axes, passed around.

The mesh is ``pp x dp x tp`` (tp innermost, so tensor-parallel ranks are neighbours, as torchtitan lays it
out), built on torch's :class:`~torch.distributed.device_mesh.DeviceMesh` with axis names ``"pp"``, ``"dp"``,
``"tp"``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from memsave.dist import groups

__all__ = ["AXES", "Mesh", "default_group_timeout", "validate_degrees"]

AXES = ("pp", "dp", "tp")


def validate_degrees(world_size: int, *, dp: int | None, tp: int, pp: int) -> tuple[int, int, int]:
    """Return ``(pp, dp, tp)`` after checking that they multiply to the world size."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"mesh degree {name}={value!r} is not allowed; expected a positive integer")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"mesh degrees tp={tp} x pp={pp} do not divide the world size {world_size}; "
            f"choose degrees whose product divides {world_size}"
        )
    if dp is None:
        dp = world_size // (tp * pp)
    if dp * tp * pp != world_size:
        raise ValueError(
            f"mesh degrees dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} do not match the world size {world_size}; "
            f"leave dp unset to use dp = world_size / (tp * pp) = {world_size // (tp * pp)}"
        )
    return pp, dp, tp


def default_group_timeout(device: torch.device) -> datetime.timedelta | None:
    """The default process group's collective timeout on ``device``'s backend; None where torch does not say."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(device)
        return backend.options._timeout  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None


@dataclasses.dataclass(eq=False)
class Mesh:
    """The ``pp x dp x tp`` layout of the processes and the device of this one.

    Attributes:
        device_mesh: torch's DeviceMesh with dim names ``("pp", "dp", "tp")``.
        device: this process's compute device.
        backend: the process-group backend (``"nccl"`` or ``"gloo"``).
        local_rank: rank on this host (selects the GPU).
    """

    device_mesh: DeviceMesh
    device: torch.device
    backend: str
    local_rank: int = 0

    @classmethod
    def build(
        cls, *, device: torch.device, dp: int | None = None, tp: int = 1, pp: int = 1, local_rank: int = 0
    ) -> Mesh:
        """A mesh over the initialized default process group."""
        if not dist.is_initialized():
            raise RuntimeError("Mesh.build needs torch.distributed initialized; call memsave.init() first")
        shape = validate_degrees(dist.get_world_size(), dp=dp, tp=tp, pp=pp)
        device_type = "cuda" if device.type == "cuda" else "cpu"
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        return cls(device_mesh=device_mesh, device=device, backend=dist.get_backend(), local_rank=local_rank)

    def degree(self, axis: str) -> int:
        """Configured size of ``axis`` (``"dp"``, ``"tp"`` or ``"pp"``)."""
        self._check_axis(axis)
        return self.device_mesh.size(AXES.index(axis))

    def axis_rank(self, axis: str) -> int:
        """This process's coordinate along ``axis``."""
        self._check_axis(axis)
        return self.device_mesh.get_local_rank(axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of the ranks that differ from this one only along ``axis``."""
        self._check_axis(axis)
        return self.device_mesh.get_group(axis)

    def groups_for(self, axes: tuple[str, ...] | list[str]) -> list[dist.ProcessGroup]:
        """The groups of ``axes`` that have more than one rank (what a placement's reduction runs over)."""
        return [self.group(a) for a in axes if self.degree(a) > 1]

    def new_group(self, axis: str, *more: str, owner: object | None = None) -> dist.ProcessGroup:
        """A *fresh* process group over the same ranks as ``axis`` (with ``more`` axes: the ranks that differ from
        this one only along those): its own ordered stream of collectives.

        Collective over the whole world (every rank creates every slice's group, as ``new_group`` requires).
        ZeRO uses one for reduce-scatters beside the axis group for all-gathers, so the two kinds never have
        to interleave in the same order on every rank. With ``owner`` (the engine), the group is destroyed at a
        later wrap once ``owner`` is gone on every rank ([Note: group lifetime] in memsave/dist/groups.py).
        """
        axes = (axis, *more)
        for a in axes:
            self._check_axis(a)
        ranks = self.device_mesh.mesh
        dims = sorted(AXES.index(a) for a in axes)
        inner = ranks.movedim(dims, list(range(ranks.dim() - len(dims), ranks.dim())))
        slices = inner.reshape(-1, math.prod(ranks.size(d) for d in dims)).tolist()
        mine = groups.create(slices, owner, self._default_timeout())
        assert mine is not None
        return mine

    def _default_timeout(self) -> datetime.timedelta | None:
        """The default group's collective timeout (``memsave.init(timeout_s=)``, ``MEMSAVE_TIMEOUT_S``), for the
        groups made here: torch gives a ``new_group`` without one its own default (30 minutes for gloo), so a hang
        on a ZeRO reduce-scatter group would outlast the timeout the user set."""
        return default_group_timeout(self.device)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def dp_size(self) -> int:
        return self.degree("dp")

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def every_rank_group(self) -> dist.ProcessGroup | None:
        """For an arrival check over every rank of the mesh (a call all of them must make): the default group
        where the mesh spans the world (None), else its dp group (a mesh over part of the world has none)."""
        spans = self.degree("dp") * self.degree("tp") * self.degree("pp") == dist.get_world_size()
        return None if spans else self.dp_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES:
            raise ValueError(f"mesh axis {axis!r} is not allowed; expected one of {', '.join(AXES)}")

    def __repr__(self) -> str:
        shape = " x ".join(f"{a}={self.degree(a)}" for a in AXES)
        return f"Mesh({shape}, rank={self.rank}, device={self.device}, backend={self.backend})"
