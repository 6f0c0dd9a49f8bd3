"""``memsave.init()`` under every way a script gets started, and the layer rule of DESIGN.md.

Each spawned process runs many cases to pay the start-up cost once:

- no launcher at all (``python train.py``): a world of one on an in-memory store, no rendezvous;
- torchrun's environment on 2 and 4 ranks: degrees, axis ranks, collectives over the mesh's groups, bad degrees;
- accelerate's environment (``accelerate launch --multi_gpu``: torchrun's variables plus accelerate's own) on
  2 ranks;
- a default process group the user created first (on its own store): reused, not created again;
- incomplete or malformed launcher variables: ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import run_ranks

# Every variable a launcher may set; cleared to get the environment of a plain `python train.py`.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_", "MASTER_")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE")

# What `accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no`
# (accelerate 1.15, CPU-only machine) exports to each process on top of the caller's environment: its own
# ACCELERATE_* settings plus torchrun's variables (accelerate runs torch.distributed.run). RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the harness, the per-rank ones are set in
# the child. Left out: TORCHELASTIC_USE_AGENT_STORE=True (it tells rank 0 that the launcher's agent already
# serves the store, and there is no agent here) and TORCHELASTIC_ERROR_FILE (a path the agent owns); the real
# launcher is exercised end to end in tests/test_examples.py.
ACCELERATE_ENV = {
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
    "ACCELERATE_MIXED_PRECISION": "no",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_NAME": "default",
    "ROLE_WORLD_SIZE": "2",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def _clear_launcher_env() -> None:
    for key in list(os.environ):
        if key in _LAUNCHER_VARS or key.startswith(_LAUNCHER_PREFIXES):
            del os.environ[key]


def _sum_over(group: object, value: float) -> float:
    """All-reduce ``value`` over ``group`` through memsave.dist (the collective path memsave itself uses)."""
    import torch

    from memsave import dist as mdist

    t = torch.tensor([value], dtype=torch.float64)
    mdist.all_reduce(t, group)  # type: ignore[arg-type]
    return t.item()


# -- no launcher -----------------------------------------------------------------------------------------------
def _no_launcher() -> str:
    _clear_launcher_env()
    assert not any(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    import torch
    import torch.distributed as dist

    import memsave
    from memsave.dist import launch_env

    assert launch_env() is None
    # degrees are checked before anything is initialized
    with pytest.raises(ValueError, match=r"tp=2.*world size 1"):
        memsave.init(tp=2)
    assert not dist.is_initialized()
    mesh = memsave.init()
    assert (mesh.rank, mesh.world_size, mesh.dp_size, mesh.dp_rank) == (0, 1, 1, 0)
    assert [mesh.degree(a) for a in ("pp", "dp", "tp")] == [1, 1, 1]
    assert mesh.device == torch.device("cpu") and mesh.backend == "gloo" and mesh.is_main
    # no rendezvous: the default group sits on an in-memory store (no port, no peers)
    store = dist.distributed_c10d._get_default_store()
    assert isinstance(getattr(store, "underlying_store", store), dist.HashStore), type(store)
    assert _sum_over(mesh.group("dp"), 3.0) == 3.0
    # a second call reuses the group
    world = dist.group.WORLD
    again = memsave.init()
    assert dist.group.WORLD is world and again.world_size == 1
    with pytest.raises(ValueError, match="'ep'"):
        mesh.group("ep")
    # LOCAL_RANK alone is not a launcher (some job schedulers export it)
    os.environ["LOCAL_RANK"] = "0"
    assert launch_env() is None
    # incomplete or malformed launcher variables name what is wrong
    _clear_launcher_env()
    os.environ["RANK"] = "0"
    with pytest.raises(ValueError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"):
        memsave.init()
    os.environ.update(WORLD_SIZE="2", MASTER_PORT="29500")
    with pytest.raises(ValueError, match="MASTER_ADDR missing") as err:
        memsave.init()
    assert "MASTER_PORT" not in str(err.value).split("missing")[0]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["RANK"] = "one"
    with pytest.raises(ValueError, match=r"RANK='one'.*integer"):
        memsave.init()
    os.environ["RANK"] = "2"
    with pytest.raises(ValueError, match="RANK=2 is not below WORLD_SIZE=2"):
        memsave.init()
    # accelerate launch --cpu --num_processes 2 starts one process with only these: the launch that makes N ranks
    _clear_launcher_env()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    with pytest.raises(ValueError, match=r"without RANK and WORLD_SIZE.*accelerate launch --multi_gpu"):
        memsave.init()
    return "ok"


def test_init_without_launcher_is_a_world_of_one() -> None:
    assert run_ranks(_no_launcher, 1, timeout=60) == ["ok"]


# -- torchrun on 4 ranks -----------------------------------------------------------------------------------------
def _torchrun_four() -> str:
    import torch.distributed as dist

    import memsave

    rank = int(os.environ["RANK"])
    # degrees that do not divide the world size fail before the rendezvous, naming the degrees
    with pytest.raises(ValueError, match=r"tp=3 x pp=1 do not divide the world size 4"):
        memsave.init(tp=3)
    with pytest.raises(ValueError, match=r"dp=3 x tp=1 x pp=1 = 3 do not match the world size 4"):
        memsave.init(dp=3)
    assert not dist.is_initialized()

    mesh = memsave.init()
    assert (mesh.rank, mesh.world_size, mesh.dp_size, mesh.dp_rank) == (rank, 4, 4, rank)
    assert (mesh.degree("tp"), mesh.degree("pp"), mesh.is_main) == (1, 1, rank == 0)
    assert mesh.local_rank == rank and mesh.backend == "gloo"
    assert _sum_over(mesh.group("dp"), rank) == 0 + 1 + 2 + 3
    assert _sum_over(mesh.dp_group, 1.0) == 4

    # dp=2 x tp=2: tp innermost, so tensor-parallel ranks are neighbours
    mesh = memsave.init(dp=2, tp=2)
    assert (mesh.dp_size, mesh.degree("tp"), mesh.degree("pp"), mesh.world_size) == (2, 2, 1, 4)
    assert (mesh.dp_rank, mesh.axis_rank("tp")) == (rank // 2, rank % 2)
    assert _sum_over(mesh.group("tp"), rank) == {0: 1, 1: 1, 2: 5, 3: 5}[rank]  # {0, 1} and {2, 3}
    assert _sum_over(mesh.group("dp"), rank) == {0: 2, 1: 4, 2: 2, 3: 4}[rank]  # {0, 2} and {1, 3}
    assert _sum_over(mesh.group("pp"), rank) == rank
    assert memsave.init(tp=2).dp_size == 2  # dp left unset: world / (tp * pp)

    # and after initialization too
    with pytest.raises(ValueError, match=r"tp=3 x pp=1 do not divide the world size 4"):
        memsave.init(tp=3)
    with pytest.raises(ValueError, match=r"dp=3 x tp=1 x pp=1 = 3 do not match the world size 4"):
        memsave.init(dp=3)
    with pytest.raises(ValueError, match=r"tp=0.*positive integer"):
        memsave.init(tp=0)
    return "ok"


def test_init_under_torchrun_env_four_ranks() -> None:
    assert run_ranks(_torchrun_four, 4, timeout=90) == ["ok"] * 4


# -- torchrun on 2 ranks, then a group the user created ----------------------------------------------------------
def _torchrun_two_then_user_group(store_path: str) -> str:
    import torch.distributed as dist

    import memsave

    rank = int(os.environ["RANK"])
    mesh = memsave.init()
    assert (mesh.rank, mesh.world_size, mesh.dp_size, mesh.dp_rank) == (rank, 2, 2, rank)
    assert (mesh.degree("tp"), mesh.degree("pp"), mesh.local_rank, mesh.is_main) == (1, 1, rank, rank == 0)
    assert _sum_over(mesh.group("dp"), 1.0 + rank) == 3.0
    with pytest.raises(ValueError, match=r"tp=3 x pp=1 do not divide the world size 2"):
        memsave.init(tp=3)
    dist.destroy_process_group()

    # the user (or accelerate's Accelerator) creates the default group first, here on a store of its own:
    # memsave.init must take it as it is, not create another one or rendezvous through MASTER_PORT
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    world = dist.group.WORLD
    mesh = memsave.init()
    assert dist.group.WORLD is world, "memsave.init replaced the user's default process group"
    assert (mesh.rank, mesh.world_size, mesh.dp_size, mesh.dp_rank) == (rank, 2, 2, rank)
    assert _sum_over(mesh.group("dp"), 10.0 * (rank + 1)) == 30.0
    assert dist.group.WORLD is world
    return "ok"


def test_init_under_torchrun_env_two_ranks_and_with_an_existing_group(tmp_path: Path) -> None:
    assert run_ranks(_torchrun_two_then_user_group, 2, str(tmp_path / "store"), timeout=60) == ["ok", "ok"]


# -- accelerate launch on 2 ranks -------------------------------------------------------------------------------
def _accelerate_env() -> str:
    rank = int(os.environ["RANK"])
    os.environ.update(ROLE_RANK=str(rank))  # per rank, as torch.distributed.run sets it
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no"
    import memsave

    # what examples/train_gpt.py does under `accelerate launch --multi_gpu`: memsave creates the group from env
    mesh = memsave.init()
    assert (mesh.rank, mesh.world_size, mesh.dp_size, mesh.dp_rank) == (rank, 2, 2, rank)
    assert (mesh.degree("tp"), mesh.degree("pp"), mesh.local_rank) == (1, 1, rank)
    assert _sum_over(mesh.group("dp"), 1.0 + rank) == 3.0
    return "ok"


def test_init_under_accelerate_env() -> None:
    assert run_ranks(_accelerate_env, 2, env=ACCELERATE_ENV, timeout=60) == ["ok", "ok"]


# -- the layer rule ---------------------------------------------------------------------------------------------
MEMSAVE = Path(__file__).resolve().parents[1] / "memsave"

# DESIGN.md's layer table, by the first name under memsave/ (a module or a package). memsave/__init__.py is a
# re-export list and exempt. Not in DESIGN.md's table: `deferred` (meta-device recording and materialization, no
# communication, beside offload/ and optim/); `_launch` (local process spawning, beside dist/), and
# with cli: `cli_args`, `cli_estimate` (parts of the `memsave` command) and `__main__`; beside `wrapped`,
# `outer_backward` (the end of the user's backward, for the data-parallel engines) and `state_view` (the wrapped
# optimizer's state by parameter) and `model_copy` (copy.deepcopy of a wrapped model), below engines/ and zero/,
# which use them, for import order; `inputs` (the tensors
# in a forward's inputs, dataclasses and BatchEncoding too) in layer 0, since dist's agreement reads them.
LAYERS = {
    "config": 0, "config_sections": 0, "config_types": 0, "phases": 0, "_logging": 0, "models": 0, "profile_docs": 0,
    "inputs": 0,
    "dist": 1, "offload": 1, "optim": 1, "wrapped": 1, "outer_backward": 1, "state_view": 1,
    "model_copy": 1, "_launch": 1, "_launch_faults": 1, "deferred": 1,
    "precision": 2, "memory": 2,
    "zero": 3, "recompute": 3, "tp": 3, "pp": 3,
    "engines": 4,
    "trainer": 5, "trainer_config": 5, "api": 5, "checkpoint": 5, "validate": 5, "estimator": 5,
    "estimate_activations": 5, "estimate_offload": 5, "estimate_pp": 5, "estimate_cuda": 5, "estimate_format": 5,
    "plan": 5,
    "cli": 6, "cli_args": 6, "cli_estimate": 6, "cli_export": 6, "cli_plan": 6, "bench": 6, "__main__": 6,
}
# `from memsave import __version__` (a name of the package root, not a submodule): the root re-exports layers
# 0-5, so only the top layer may import from it.
ROOT = "<memsave package root>"
LAYERS[ROOT] = 6

# Uses of torch.distributed outside memsave/dist/ that are known bugs, reported to be fixed (path, name).
KNOWN_DIST_USES: set[tuple[str, str]] = set()


def _modules() -> list[Path]:
    return sorted(p for p in MEMSAVE.rglob("*.py") if p != MEMSAVE / "__init__.py")


def _layer_key(path: Path) -> str:
    rel = path.relative_to(MEMSAVE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _is_submodule(name: str) -> bool:
    return (MEMSAVE / f"{name}.py").is_file() or (MEMSAVE / name / "__init__.py").is_file()


def _memsave_imports(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, first name under memsave/)`` for every memsave import in the file, lazy ones included."""
    rel = path.relative_to(MEMSAVE)
    package = ["memsave", *rel.parts[:-1]]  # the package this module lives in
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "memsave":  # from memsave import dist, zero
                names = [(node.lineno, f"memsave.{a.name}") for a in node.names]
            else:
                names = [(node.lineno, module)]
        else:
            continue
        for line, name in names:
            parts = name.split(".")
            if parts[0] != "memsave":
                continue
            if len(parts) == 1 or not _is_submodule(parts[1]):
                found.append((line, ROOT))
            else:
                found.append((line, parts[1]))
    return found


def test_layers_import_only_downward() -> None:
    modules = _modules()
    assert len(modules) > 10, modules
    unknown = sorted({_layer_key(p) for p in modules} - set(LAYERS))
    assert not unknown, f"memsave modules {unknown} have no layer: add them to LAYERS here and to DESIGN.md"
    errors = []
    for path in modules:
        own = _layer_key(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in _memsave_imports(path, tree):
            where = f"memsave/{path.relative_to(MEMSAVE)}:{line}"
            if LAYERS[target] > LAYERS[own]:
                errors.append(f"{where}: {own} (layer {LAYERS[own]}) imports {target} (layer {LAYERS[target]})")
    assert not errors, "imports that go up the layer table of DESIGN.md:\n" + "\n".join(errors)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _distributed_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Imports of torch.distributed (any submodule) and ``torch.distributed.x`` attribute chains."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            uses += [(node.lineno, f"{module}.{a.name}") if module == "torch" else (node.lineno, module)
                     for a in node.names]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            name = _dotted(node)
            if name and name.split(".")[:2] == ["torch", "distributed"]:
                uses.append((node.lineno, ".".join(name.split(".")[:3])))
    return [(line, name) for line, name in uses if name == "torch.distributed" or name.startswith("torch.distributed.")]


def test_torch_distributed_only_under_dist() -> None:
    errors = []
    for path in _modules():
        rel = path.relative_to(MEMSAVE)
        if rel.parts[0] == "dist":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # mark parents so only the outermost attribute chain is reported
            for child in ast.iter_child_nodes(node):
                child.parent = node  # type: ignore[attr-defined]
        for line, name in sorted(set(_distributed_uses(tree))):
            if (rel.as_posix(), name) not in KNOWN_DIST_USES:
                errors.append(f"memsave/{rel.as_posix()}:{line} uses {name}")
    assert not errors, "torch.distributed outside memsave/dist/ (go through memsave.dist):\n" + "\n".join(errors)


def test_layer_checker_sees_violations() -> None:
    """The checks above find what they are meant to: parse made-up sources as if they lived in memsave/."""
    src = "from memsave.api import wrap\nfrom ..zero import shard\nimport torch.distributed as dist\n"
    tree = ast.parse(src)
    assert _memsave_imports(MEMSAVE / "memory" / "report.py", tree) == [(1, "api"), (2, "zero")]
    assert _memsave_imports(MEMSAVE / "config.py", ast.parse("from memsave import wrap, dist\n")) == [
        (1, ROOT), (1, "dist")]
    tree = ast.parse("import torch\nfrom torch import distributed\nx = torch.distributed.ReduceOp.MAX\n"
                     "import torch.multiprocessing as mp\nfrom torch.distributed.device_mesh import DeviceMesh\n")
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]
    assert sorted(set(_distributed_uses(tree))) == [
        (2, "torch.distributed"), (3, "torch.distributed.ReduceOp"), (5, "torch.distributed.device_mesh")]


def test_import_leaves_dcp_until_a_checkpoint() -> None:
    """``import memsave`` and the ``memsave`` command do not import torch.distributed.checkpoint (a second of DTensor
    and sympy; memsave/dist/dcp_store.py is imported by the first save or load)."""
    code = ("import sys, memsave, memsave.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.checkpoint', "
            "'torch.distributed.tensor', 'memsave.dist.dcp_store'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_local_rank_without_a_gpu_of_its_own_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on a one-GPU machine: NCCL would fail only at the first collective ("Duplicate GPU detected"),
    so the device is refused where it is chosen, saying how many GPUs there are and what to do instead."""
    import torch

    from memsave.dist import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert default_device(0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"local rank 1 has no CUDA device of its own: 1 visible "
                                         r"\(CUDA_VISIBLE_DEVICES='0'\).*CUDA_VISIBLE_DEVICES=\) to run every rank"):
        default_device(1)
