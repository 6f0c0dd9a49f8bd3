"""The profile's ``[parallel]`` section (issue 18, B): ``tp`` and ``pp`` are validated like every key, round-trip
through TOML, dicts and ``parallel.tp=2`` overrides, and are the mesh degrees ``memsave.init(profile=...)``
builds; an explicit ``tp=``/``pp=`` that contradicts the profile is a ``ValueError`` naming both. ``memsave demo
--parallel.tp=2`` reaches the mesh its ranks build. (Whether ``memsave.wrap`` can use a tp or pp axis is not
tested here.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from memsave.cli import main
from memsave.config import ParallelConfig, Profile, load_profile
from tests.harness import run_ranks


def test_parallel_section_defaults_overrides_and_round_trip(tmp_path: Path) -> None:
    assert Profile().parallel == ParallelConfig(tp=1, pp=1)
    assert load_profile("zero3").parallel == ParallelConfig()
    p = load_profile("zero3", ["parallel.tp=2", "--parallel.pp=2"])
    assert (p.parallel.tp, p.parallel.pp, p.zero.stage) == (2, 2, 3)
    assert p.to_dict()["parallel"] == {"tp": 2, "pp": 2, "schedule": "1f1b", "virtual": 1, "split": (),
                                       "balance": "count", "gather": "step", "sequence": False}
    assert Profile.from_dict(p.to_dict()) == p
    path = tmp_path / "tp2.toml"
    path.write_text("[parallel]\ntp = 2\n\n[zero]\nstage = 2\n")
    assert load_profile(path).parallel == ParallelConfig(tp=2)


def test_parallel_section_built_in_code_is_checked() -> None:
    """(Bad overrides and TOML values are in tests/test_config.py's BAD_OVERRIDES.)"""
    with pytest.raises(ValueError, match=r"'parallel\.tp' = 0 .*positive integer"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match=r"'parallel\.pp' = True .*integer"):
        ParallelConfig(pp=True)


def _init_with_profiles() -> dict:
    import memsave
    from memsave import cli

    out: dict = {}
    tp2 = load_profile("zero2", ["parallel.tp=2"])
    for kwargs in ({"tp": 1}, {"pp": 2}):
        with pytest.raises(ValueError) as err:
            memsave.init(profile=tp2, **kwargs)
        out["conflict", *kwargs] = str(err.value)
    mesh = memsave.init(profile=tp2)
    out["tp2"] = [mesh.degree(a) for a in ("pp", "dp", "tp")]
    out["tp2 agreeing"] = [memsave.init(profile=tp2, tp=2).degree(a) for a in ("pp", "dp", "tp")]
    out["preset"] = [memsave.init(profile="zero3").degree(a) for a in ("pp", "dp", "tp")]
    out["no profile"] = [memsave.init(pp=2).degree(a) for a in ("pp", "dp", "tp")]

    # memsave demo's own rank function, up to wrap: the mesh it built from --parallel.tp=2
    class Built(Exception):
        pass

    def stop_at_wrap(*args: object, mesh: memsave.Mesh, **kwargs: object) -> None:
        raise Built([mesh.degree(a) for a in ("pp", "dp", "tp")])

    cli.wrap = stop_at_wrap  # type: ignore[assignment]
    args, extra = cli.build_parser().parse_known_args(
        ["demo", "--size", "tiny", "--nproc", "2", "--steps", "1", "--profile", "zero2", "--parallel.tp=2"])
    opts, _ = cli._demo_options(args, extra)
    with pytest.raises(Built) as built:
        cli._demo_worker(opts)
    out["demo"] = built.value.args[0]
    return out


def test_init_takes_the_profile_degrees_and_refuses_a_conflict() -> None:
    out = run_ranks(_init_with_profiles, 2, timeout=90)
    assert out[0] == out[1]
    got = out[0]
    assert "tp=1" in got["conflict", "tp"] and "[parallel] tp = 2" in got["conflict", "tp"], got
    assert "pp=2" in got["conflict", "pp"] and "[parallel] pp = 1" in got["conflict", "pp"], got
    assert "'zero2'" in got["conflict", "tp"]
    assert got["tp2"] == got["tp2 agreeing"] == got["demo"] == [1, 1, 2]  # pp, dp, tp
    assert got["preset"] == [1, 2, 1]
    assert got["no profile"] == [2, 1, 1]


def test_demo_refuses_degrees_that_do_not_divide_the_processes(capsys: pytest.CaptureFixture[str]) -> None:
    """Before any process starts: one line, exit code 2."""
    assert main(["demo", "--size", "tiny", "--nproc", "3", "--parallel.tp=2", "--report-dir", ""]) == 2
    err = capsys.readouterr().err
    assert "tp=2" in err and "world size 3" in err, err
    assert main(["demo", "--size", "tiny", "--parallel.pp=0", "--report-dir", ""]) == 2
    assert "'parallel.pp' = 0" in capsys.readouterr().err
