"""The ``memsave`` command when things go wrong: a rendezvous port taken by another process (``memsave bench``
retries, keeps the finished rows and names the configuration that failed), bad model fields for ``memsave
estimate`` (one line, exit code 2), one report folder per ``memsave demo`` run, and warnings printed by rank 0
only while errors print on every rank."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import memsave
from memsave import _launch, _logging
from memsave.cli import main, new_run_dir
from tests.harness import LogRecords, run_ranks

BENCH = ["bench", "--size", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--warmup", "1",
         "--nproc", "1"]  # one process per launch keeps the four launches cheap; two ranks: the next test


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process holds: a socket listening on it (rank 0's store cannot bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_bench_survives_a_taken_port_and_keeps_finished_rows(
        taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """ddp's first launch finds its port taken and runs again on a free one; every launch of zero2 finds it
    taken: the error names zero2 and the ports, and ddp's row is printed and written all the same."""
    real = _launch.free_port
    ports = iter([taken_port, None, taken_port, taken_port])  # None: a really free port
    monkeypatch.setattr(_launch, "free_port", lambda: next(ports) or real())
    monkeypatch.setattr(_launch, "PORT_ATTEMPTS", 2)
    said = LogRecords()
    _logging.get_logger().addHandler(said)
    out_json = tmp_path / "bench.json"
    try:
        code = main([*BENCH, "--configs", "ddp,zero2", "--json", str(out_json)])
    finally:
        _logging.get_logger().removeHandler(said)
    out, err = capsys.readouterr()
    assert code == 1, err
    assert next(ports, "used up") == "used up"  # 2 launches of ddp, 2 of zero2
    assert [m for m in said.messages if f"port {taken_port} was taken" in m and "again on another port" in m], said
    # the finished row, then the failed configuration named, in the output and in the error
    lines = out.splitlines()
    assert lines[0].startswith("config") and lines[1].startswith("ddp ") and "zero2 " not in out.split("model:")[0]
    assert "1 configuration finished; 'zero2' failed and the rest did not run" in out
    first = next(line for line in err.splitlines() if line.startswith("memsave bench:"))
    assert first.startswith("memsave bench: configuration 'zero2' failed: rank 0 of 1 failed: DistNetworkError"), err
    assert "EADDRINUSE" in first and f"taken on all 2 launches: ports {taken_port}, {taken_port}" in first
    data = json.loads(out_json.read_text())
    assert [r["name"] for r in data["rows"]] == ["ddp"] and data["failed"] == "zero2"
    assert data["rows"][0]["reference"] == "ddp" and data["rows"][0]["final_loss_diff"] == 0.0


def _rendezvous() -> int:
    return memsave.init().rank


def test_spawn_local_two_ranks_move_to_a_free_port(taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 cannot listen on the taken port while rank 1 connects to whoever holds it: both are stopped and
    the launch runs again on a free port."""
    real = _launch.free_port
    launched: list[int] = []

    def pick() -> int:  # the taken port first, then free ones (a free one taken meanwhile is retried as well)
        launched.append(real() if launched else taken_port)
        return launched[-1]

    monkeypatch.setattr(_launch, "free_port", pick)
    assert _launch.spawn_local(_rendezvous, 2, timeout_s=120) == [0, 1]
    assert launched[0] == taken_port and len(launched) >= 2, launched


def test_spawn_local_retries_only_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry loop alone (no processes): a rank that raises anything else ends the launch the first time."""
    launches: list[int] = []

    def launch(fn: object, nprocs: int, args: tuple, timeout_s: float, port: int) -> list[int]:
        launches.append(port)
        if len(launches) == 1:
            raise _launch.LaunchError("rank 0 of 1 failed", rank=0, exc_type="DistNetworkError",
                                      message="The server socket has failed to listen ... name: EADDRINUSE")
        raise _launch.LaunchError("rank 0 of 1 failed", rank=0, exc_type="KeyError", message="'x'")

    monkeypatch.setattr(_launch, "_launch_once", launch)
    with pytest.raises(_launch.LaunchError) as info:
        _launch.spawn_local(print, 1, timeout_s=60)
    assert info.value.exc_type == "KeyError" and len(launches) == 2  # a fresh free_port() for each launch


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "gpt:tiny,n_layer=-1"], "GPTConfig.n_layer=-1: must be a positive int"),
    (["--model", "gpt:tiny,n_layer=abc"], "n_layer='abc' is not allowed; expected an integer"),
    (["--model", "gpt:tiny,n_layers=4"], "'n_layers' is not a field of the GPT; the fields are vocab_size, "),
    (["--model", "gpt:tiny,tie_weights=3"], "tie_weights='3' is not allowed; expected true or false"),
    (["--model", "gpt:tiny,dropout=x"], "dropout='x' is not allowed; expected a number"),
    (["--model", "gpt:tiny,n_layer"], "'n_layer' is not key=value"),
    (["--n-layer", "-1"], "unrecognized argument '--n-layer'; profile overrides look like --zero.stage=2 and the "
                          "GPT's fields go in --model"),
    (["--world-size", "two"], "argument --world-size: invalid int value: 'two'"),
    (["--seq-len", "-5"], "--seq-len -5 is not allowed; expected a positive integer"),
    (["--batch-size", "0"], "--batch-size 0 is not allowed"),
])
def test_estimate_bad_model_field_is_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--profile", "zero2", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("memsave estimate: error: ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""


def test_estimate_model_fields_still_parse(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--profile", "zero2", "--model", "gpt:tiny, n_layer=3,tie_weights=FALSE,dropout=0.1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "zero2"


def test_each_demo_run_gets_its_own_report_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs in the same second, and a TOML profile with a space in its name: distinct folders, created."""
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260102-030405")
    first, second = new_run_dir(tmp_path / "runs", "zero2"), new_run_dir(tmp_path / "runs", "zero2")
    odd = new_run_dir(tmp_path / "runs", "my profile/v2")
    assert [p.name for p in (first, second, odd)] == ["zero2-20260102-030405", "zero2-20260102-030405-2",
                                                      "my_profile_v2-20260102-030405"]
    assert all(p.is_dir() and p.parent == tmp_path / "runs" for p in (first, second, odd))


def test_demo_prints_its_report_dir_and_a_failed_run_leaves_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's folder goes to the processes as TrainConfig.report_dir; a run that fails removes it (empty)."""
    from memsave import cli

    seen: list[str] = []

    def fail(fn: object, nproc: int, args: tuple, *, timeout_s: float) -> None:
        seen.append(args[0].train.report_dir)
        assert Path(seen[-1]).is_dir() and Path(seen[-1]).parent == tmp_path / "runs"
        raise _launch.LaunchError("rank 0 of 1 failed: RuntimeError: boom", rank=0, exc_type="RuntimeError",
                                  message="boom")

    monkeypatch.setattr(cli, "spawn_local", fail)
    assert main(["demo", "--size", "tiny", "--nproc", "1", "--profile", "zero2", "--report-dir",
                 str(tmp_path / "runs")]) == 1
    assert "boom" in capsys.readouterr().err and len(seen) == 1
    assert re.fullmatch(r"zero2-\d{8}-\d{6}", Path(seen[0]).name) and list((tmp_path / "runs").iterdir()) == []


# -- warnings on rank 0, errors everywhere -------------------------------------------------------------------------
def _log_on_each_rank() -> list[str]:
    """A warn_once (twice) and an error on this rank, as memsave's handler prints them: with the launcher's
    RANK, then without it (a process group set up by hand: torch.distributed's rank is the one that counts)."""
    memsave.init()
    _logging.get_logger()  # creates memsave's printing handler; print into a buffer instead of stderr
    printed = logging.getLogger("memsave").handlers[0]
    assert isinstance(printed, logging.StreamHandler)
    out = []
    for case in ("env", "process group"):
        if case == "process group":
            del os.environ["RANK"]
        stream = io.StringIO()
        printed.setStream(stream)
        _logging.warn_once(f"[zero] a setting ignored on this hardware ({case})")
        _logging.warn_once(f"[zero] a setting ignored on this hardware ({case})")
        _logging.get_logger().error("something failed here")
        out.append(stream.getvalue())
    return out


def test_warn_once_prints_on_rank_0_errors_on_every_rank() -> None:
    printed = run_ranks(_log_on_each_rank, 2, timeout=60)
    for i, case in enumerate(("env", "process group")):
        assert printed[0][i] == (f"[memsave rank0] WARNING [zero] a setting ignored on this hardware ({case})\n"
                                 "[memsave rank0] ERROR something failed here\n")
        assert printed[1][i] == "[memsave rank1] ERROR something failed here\n"


def test_warn_once_still_reaches_added_handlers_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler a caller adds sees the record on any rank (the rank filter is on memsave's printing handler)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(_logging, "_warned", set())
    said = LogRecords()
    _logging.get_logger().addHandler(said)
    try:
        _logging.warn_once("once")
        _logging.warn_once("once")
    finally:
        _logging.get_logger().removeHandler(said)
    assert said.messages == ["once"]
