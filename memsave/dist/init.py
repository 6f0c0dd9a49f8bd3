"""``memsave.init()``: join the process group that the launcher describes, or run as one process.

``torchrun`` and ``accelerate launch --multi_gpu`` both export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; from these we rendezvous through the ``env://`` method. With none of them
set we start a world of one on an in-memory store (no port, no rendezvous), so the same script runs unchanged
as ``python train.py``. If the default process group already exists (the user or accelerate created it), it is
used as it is.

The mesh degrees come from the arguments or from a profile's ``[parallel]`` section (``init(profile="zero3")``,
``--parallel.tp=2`` on the command line); an argument that contradicts the profile is an error, not a choice.

[Note: elastic restarts] ``torchrun --max-restarts N`` restarts every rank after one dies, on the same store (the
agent's). The restarted ranks would read the keys the first attempt left there, gloo's among them, and connect to
the dead rank's old address ("Gloo connectFullMesh failed ... Connection refused"; a plain torch script fails
the same way on torch 2.13). So under an elastic agent the store is wrapped in a prefix per
``TORCHELASTIC_RESTART_COUNT``: each attempt rendezvouses in keys of its own.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memsave._logging import get_logger, warn_once
from memsave.config import Profile, load_profile
from memsave.dist.collectives import shutdown_at_exit
from memsave.dist.host_memory import configure_host_memory
from memsave.dist.mesh import Mesh, default_group_timeout, validate_degrees

__all__ = ["check_accelerate_precision", "check_accelerate_world", "default_device", "init", "launch_env"]

_LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_env() -> dict[str, str] | None:
    """The launcher's variables, or None when no launcher set them. Partial settings are an error."""
    present = {k: os.environ[k] for k in _LAUNCH_KEYS if k in os.environ}
    if not present or set(present) == {"LOCAL_RANK"}:
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in present]
    if {"RANK", "WORLD_SIZE"} <= set(missing) and "MASTER_ADDR" in present:  # a launcher of one process
        raise ValueError(
            "launcher environment is incomplete: MASTER_ADDR and MASTER_PORT are set without RANK and WORLD_SIZE, "
            "as accelerate launch's one-process launcher sets them (`accelerate launch --cpu --num_processes N` "
            "starts one process). For N ranks on CPUs use `accelerate launch --multi_gpu --num_processes N` "
            "(with Accelerator(cpu=True)) or `torchrun --nproc-per-node N`; for one process unset MASTER_ADDR "
            "and MASTER_PORT")
    if missing:
        raise ValueError(
            f"launcher environment is incomplete: {', '.join(missing)} missing (have {', '.join(sorted(present))}); "
            "launch with torchrun / accelerate launch, or unset them all to run as one process"
        )
    for key in ("RANK", "WORLD_SIZE"):
        if not present[key].isdigit():
            raise ValueError(f"environment variable {key}={present[key]!r} is not allowed; expected an integer")
    if int(present["RANK"]) >= int(present["WORLD_SIZE"]):
        raise ValueError(f"environment RANK={present['RANK']} is not below WORLD_SIZE={present['WORLD_SIZE']}")
    present.setdefault("LOCAL_RANK", present["RANK"])
    return present


def default_device(local_rank: int) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU. A local rank without a GPU of its own is an
    error: NCCL refuses two ranks on one GPU only once they first talk, and sharing one would be wrong anyway."""
    # (with CUDA_VISIBLE_DEVICES= torch 2.11 can say is_available() and count no device: the CPU then)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        if local_rank >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(
                f"local rank {local_rank} has no CUDA device of its own: {count} visible"
                f"{'' if visible is None else f' (CUDA_VISIBLE_DEVICES={visible!r})'}, and NCCL cannot put two "
                f"ranks on one GPU; start at most {count} process(es) per node, or hide the GPUs "
                "(CUDA_VISIBLE_DEVICES=) to run every rank on the CPU with gloo")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _degrees(tp: int | None, pp: int | None, profile: str | Path | Profile | None) -> tuple[int, int]:
    """``(tp, pp)`` from the arguments and the profile's ``[parallel]`` section, which must agree."""
    if profile is None:
        return (1 if tp is None else tp), (1 if pp is None else pp)
    prof = load_profile(profile)  # ValueError names a bad key or value
    wanted = {"tp": prof.parallel.tp, "pp": prof.parallel.pp}
    for axis, given in (("tp", tp), ("pp", pp)):
        if given is not None and given != wanted[axis]:
            raise ValueError(
                f"memsave.init({axis}={given!r}) conflicts with profile {prof.name!r}'s [parallel] {axis} = "
                f"{wanted[axis]}; leave {axis}= unset to take the profile's, or set parallel.{axis}={given!r} in it"
            )
    return wanted["tp"], wanted["pp"]


def init(
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    profile: str | Path | Profile | None = None,
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout_s: float | None = None,
    host_trim: bool = True,
    host_mmap_threshold: int = 0,
) -> Mesh:
    """Initialize ``torch.distributed`` (if needed) and return the ``pp x dp x tp`` :class:`Mesh`.

    Args:
        dp, tp, pp: mesh degrees. ``tp`` and ``pp`` default to the profile's ``[parallel]`` degrees, else 1;
            ``dp`` defaults to ``world_size / (tp * pp)``. Degrees that do not multiply to the world size, or a
            ``tp``/``pp`` that differs from the profile's, raise ``ValueError``.
        profile: a preset name, a TOML path or a :class:`~memsave.config.Profile` whose ``[parallel]`` section
            gives ``tp`` and ``pp``.
        backend: ``"nccl"`` or ``"gloo"``; by default nccl for CUDA devices, gloo otherwise.
        device: the compute device; by default ``cuda:LOCAL_RANK`` when CUDA is there, else CPU.
        timeout_s: collective timeout (default: ``MEMSAVE_TIMEOUT_S`` or 600 s).
        host_trim, host_mmap_threshold: on CPU, the host-allocator policy (see [Note: host allocator] in
            ``memsave/dist/host_memory.py``): give the forward's freed heap back to the OS at the end of each
            forward (default on), and optionally pin glibc's mmap threshold (bytes; 0 = off). Ignored on GPU.
    """
    tp, pp = _degrees(tp, pp, profile)
    env = launch_env()
    local_rank = int(env["LOCAL_RANK"]) if env else int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device(device) if device is not None else default_device(local_rank)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not allowed; expected 'nccl' or 'gloo'")
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got device={dev}; use backend='gloo' on CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        configure_host_memory(trim_after_forward=host_trim, mmap_threshold=host_mmap_threshold)
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("MEMSAVE_TIMEOUT_S", 600)))

    if not dist.is_initialized():
        world_size = int(env["WORLD_SIZE"]) if env else 1
        validate_degrees(world_size, dp=dp, tp=tp, pp=pp)  # fail before any rendezvous
        if env is None:
            # One process, no launcher: an in-memory store needs no free port and no peers.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            kwargs = {"device_id": dev} if dev.type == "cuda" else {}
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            if restart is None:
                dist.init_process_group(backend, init_method="env://", timeout=timeout, **kwargs)  # type: ignore[arg-type]
            else:  # [Note: elastic restarts]
                store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
                store = dist.PrefixStore(f"memsave/restart{restart}/", store)
                dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                                        **kwargs)  # type: ignore[arg-type]
        atexit.register(shutdown_at_exit)  # [Note: gloo at exit]: a script that ends without shutdown()
    else:
        if dist.get_backend() != backend:
            get_logger().info("using the existing %s process group (asked for %s)", dist.get_backend(), backend)
        running = default_group_timeout(dev)
        if timeout_s is not None and running is not None and running != timeout:  # not a silent no-op
            warn_once(f"memsave.init(timeout_s={timeout_s:g}) is not applied: the process group exists already, with "
                      f"a collective timeout of {running.total_seconds():g} s; set it where the group is made (the "
                      "first memsave.init, or MEMSAVE_TIMEOUT_S)")
    key = (dev, dp, tp, pp, local_rank)
    default = dist.distributed_c10d._get_default_group()
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is default:  # [Note: one mesh per layout]
        mesh = cached[1]
    else:
        mesh = Mesh.build(device=dev, dp=dp, tp=tp, pp=pp, local_rank=local_rank)
        _MESHES[key] = (default, mesh)
        get_logger().info("initialized %r", mesh)
    check_accelerate_world(dist.get_world_size())
    return mesh


# [Note: one mesh per layout] ``wrap`` without ``mesh=`` calls ``init()``, and every DeviceMesh builds process
# groups of its own (one per axis slice), never freed: a sweep of wraps in one process leaked them
# ([Note: group lifetime] in memsave/dist/groups.py). A layout is built once per default group and given back
# to every later ``init`` asking for it; shutdown() forgets them.
_MESHES: dict[tuple[Any, ...], tuple[Any, Mesh]] = {}


def forget_meshes() -> None:
    """The default group went: its meshes' groups went with it."""
    _MESHES.clear()


def check_accelerate_world(world: int) -> None:
    """[Note: accelerate's process count] A plain ``Accelerator()`` on a CPU machine under ``accelerate launch
    --multi_gpu`` counts one process (``DistributedType.NO``: it does not start torch.distributed) while memsave
    runs ``world`` ranks: its dataloader then gives every rank the whole batch while memsave averages the
    gradients over the ranks, another training than the user planned, with no error (a review measured
    parameters 0.8 relative off a single-process run). Refused where accelerate's state exists and disagrees
    (checked by ``init`` and by ``validate`` for ``wrap`` and ``parallelize``; accelerate is never
    imported here)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None) or {}
    counted = shared.get("num_processes")
    if counted is not None and counted != world:
        raise ValueError(
            f"accelerate counts {counted} process(es) where memsave runs {world} rank(s) (torch.distributed's world): "
            "accelerate's dataloader would not split the data over the ranks that memsave averages gradients over. "
            "On a CPU machine build Accelerator(cpu=True) (accelerate then starts gloo for every launched "
            "process); elsewhere create the Accelerator from the same launch as memsave.init()")


def check_accelerate_precision(compute: str) -> None:
    """[Note: accelerate's mixed precision] ``Accelerator(mixed_precision="bf16")`` autocasts the forward of the
    models it prepares, and memsave's recipe keeps the model out of ``prepare`` (it would add DDP): the setting then
    does nothing, and a run meant for bf16 computed in fp32 with no word (a review: bitwise equal to
    ``mixed_precision="no"``). Said once, at ``wrap``, where accelerate's state asks for bf16, fp16 or fp8 and the
    profile computes in fp32 (accelerate is never imported here)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None) or {}
    asked = str(shared.get("_mixed_precision", "no"))
    if asked not in ("no", compute) and compute == "fp32":
        warn_once(f"accelerate's mixed_precision={asked!r} applies only to a model accelerator.prepare wraps, which "
                  "memsave's model is not: its forward runs in fp32 unless under accelerator.autocast(). For "
                  f"{asked} use a profile with [precision] compute = "
                  f"\"{asked if asked in ('bf16', 'fp16') else 'bf16'}\" (e.g. zero2-bf16), or that autocast")
