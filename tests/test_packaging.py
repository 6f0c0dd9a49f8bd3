"""The presets ship with every way memsave is installed or run (issue 18): they live in the top-level
``profiles/`` folder, which pyproject.toml installs as the package ``memsave.profiles``.

- pyproject.toml lists every package under ``memsave/`` (a mapped folder rules out ``packages.find``);
- a non-editable ``pip install`` into a clean venv puts the presets inside the installed package, and from a
  folder outside the repository every preset loads and ``memsave profiles`` lists them all;
- an editable install reads the checkout's ``profiles/`` (also through ``importlib.resources``);
- a checkout on ``PYTHONPATH`` with nothing installed (how the GPU machines run it) reads its own ``profiles/``.

Each install is from a copy of the repository, so no ``build/`` or ``memsave.egg-info`` lands in the checkout.
The venvs see the system site-packages (torch comes from there) and are made without pip: the system's pip and
setuptools run in them (a venv's own bundled setuptools is older than pyproject.toml's and has no wheel
builder), with ``--no-deps --no-build-isolation`` and no index, so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "profiles").glob("*.toml"))
# what each venv's python prints about the memsave it imports, from a folder outside the repository
CHECK = """
import importlib.resources, json, memsave
from memsave.config import PRESET_DIR
loaded = {name: memsave.load_profile(name).name for name in memsave.list_presets()}
print(json.dumps({"memsave": memsave.__file__, "preset_dir": str(PRESET_DIR), "loaded": loaded,
                  "package": str(importlib.resources.files("memsave.profiles"))}))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    env.update(OMP_NUM_THREADS="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def _copy_of_repo(dest: Path) -> Path:
    """The checkout without git, build outputs, caches and runs (``dist``/``build`` at the top only: memsave/dist
    is a package)."""
    everywhere = shutil.ignore_patterns("__pycache__", "*.egg-info", ".*_cache", "*.pt")

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = {".git", "build", "dist", "runs", ".venv"} if Path(folder) == ROOT else set()
        return set(everywhere(folder, names)) | (top & set(names))

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def _venv_with(tmp: Path, name: str, *install: str) -> Path:
    """A venv over the system site-packages with ``pip install --no-deps --no-build-isolation *install``; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp / name)],
                   check=True, timeout=60)
    python = tmp / name / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *install], cwd=tmp)
    return python


def _check(python: Path | str, cwd: Path, env: dict[str, str] | None = None) -> dict:
    return json.loads(_run([str(python), "-c", CHECK], cwd=cwd, env=env).splitlines()[-1])


def test_pyproject_lists_every_package_and_maps_the_presets() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "memsave").rglob("__init__.py")}
    assert set(setuptools["packages"]) == packages | {"memsave.profiles"}, (
        "pyproject.toml [tool.setuptools] packages must list every package under memsave/")
    assert setuptools["package-dir"]["memsave.profiles"] == "profiles"
    assert setuptools["package-data"]["memsave.profiles"] == ["*.toml"]
    assert PRESETS and not (ROOT / "memsave" / "profiles").exists()


def test_installs_ship_the_presets(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    # non-editable: the presets are files inside the installed package
    wheel_python = _venv_with(tmp_path, "venv", str(_copy_of_repo(tmp_path / "src")))
    site = Path(_run([str(wheel_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=outside).strip())
    got = _check(wheel_python, outside)
    assert Path(got["memsave"]) == site / "memsave" / "__init__.py"
    assert Path(got["preset_dir"]) == Path(got["package"]) == site / "memsave" / "profiles"
    assert got["loaded"] == {name: name for name in PRESETS}
    for name in PRESETS:
        assert (site / "memsave" / "profiles" / f"{name}.toml").read_bytes() == (
            ROOT / "profiles" / f"{name}.toml").read_bytes()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "memsave").rglob("*.py")}
    assert modules <= {p.relative_to(site).as_posix() for p in (site / "memsave").rglob("*.py")}
    listed = _run([str(wheel_python.parent / "memsave"), "profiles"], cwd=outside)
    assert [line.split()[0] for line in listed.splitlines()] == PRESETS, listed

    # editable: the copy's own profiles/, also where importlib.resources finds memsave.profiles
    src = _copy_of_repo(tmp_path / "editable-src")
    got = _check(_venv_with(tmp_path, "venv-editable", "-e", str(src)), outside)
    assert Path(got["memsave"]) == src / "memsave" / "__init__.py"
    assert Path(got["preset_dir"]) == Path(got["package"]) == src / "profiles"
    assert got["loaded"] == {name: name for name in PRESETS}
    assert not (src / "memsave.egg-info").exists() and not (src / "build").exists()


def test_a_checkout_on_pythonpath_reads_its_own_presets(tmp_path: Path) -> None:
    """No install (the GPU machines run ``PYTHONPATH=. python ...``): ``memsave.profiles`` is not importable, or is
    another install's, and the checkout's ``profiles/`` is read."""
    code = ("import memsave; from memsave.config import PRESET_DIR; memsave.load_profile('zero3'); "
            "print(PRESET_DIR); print(*memsave.list_presets())")
    out = _run([sys.executable, "-c", code], cwd=tmp_path, env={**_env(), "PYTHONPATH": str(ROOT)}).splitlines()
    assert out == [str(ROOT / "profiles"), " ".join(PRESETS)]
