"""Memory report files and pages: the ``memsave.report/2`` validator (errors name the JSON path), save/load
round trip and the v1 conversion, the text table (the categories at the peak sample apart from each one's maximum
over the run) and the step holding the peak phase by phase, the self-contained HTML page opened in headless
Chromium (charts drawn, the zoomed step among them, no console error: proven able to fail on deliberately broken
pages), and ``memsave report``."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from memsave.cli import main
from memsave.memory import load_report, render_html, save_report, validate_report
from memsave.memory.html import expected_charts
from memsave.memory.schema import (
    CATEGORIES,
    OFF_DEVICE,
    PHASES,
    format_bytes,
    format_text,
    in_memory_total,
    peak_step,
)
from memsave.phases import MemoryCategory, Phase

MiB = 1 << 20
STEPS = (("forward", 5), ("backward", 6), ("optimizer", 2), ("idle", 2))  # 15 samples a step


def make_report(name: str, *, ranks: int = 2, timeline: bool = True, estimate: bool = True,
                offload: bool = True, scale: float = 1.0) -> dict[str, Any]:
    """A tracker-like report: 2 steps x 15 samples through every phase, units gathered in forward/backward."""
    cats = ["params", "params_gathered", "grads", "optimizer_state", "activations", "buffers", "comm"]
    cats += ["offload_host"] if offload else []
    out = []
    for r in range(ranks):
        held = {"params": int(40 * MiB * scale), "optimizer_state": int(80 * MiB * scale), "buffers": MiB}
        held.update({"offload_host": int(120 * MiB * scale)} if offload else {})
        samples, t = [], 0.0
        for step in range(2):
            for phase, n in STEPS:
                for i in range(n):
                    b = dict(held)
                    if phase == "forward":
                        b.update(activations=int((i + 1) * 20 * MiB * scale), params_gathered=int(10 * MiB * scale))
                    elif phase == "backward":
                        b.update(activations=int((n - i) * 16 * MiB * scale), grads=int((i + 1) * 8 * MiB * scale),
                                 params_gathered=int(10 * MiB * scale), comm=4 * MiB)
                    elif phase == "optimizer":
                        b.update(grads=int(48 * MiB * scale))
                    t += 0.01 + 0.002 * r
                    unit = f"blocks.{i}" if phase in ("forward", "backward") else None
                    samples.append({"t": round(t, 4), "step": step, "phase": phase, "unit": unit,
                                    "event": f"post_{phase}", "bytes": b, "rss": in_memory_total(b) + 200 * MiB,
                                    "device_allocated": 0})
        top = max(samples, key=lambda s: in_memory_total(s["bytes"]))
        phases: dict[str, Any] = {}
        for s in samples:
            entry = phases.setdefault(s["phase"], {"peak_total": -1, "bytes": {}})
            if in_memory_total(s["bytes"]) > entry["peak_total"]:
                entry.update(peak_total=in_memory_total(s["bytes"]), bytes=dict(s["bytes"]))
        total = in_memory_total(top["bytes"])
        out.append({
            "rank": r, "current": dict(held),
            "peak": {"total": total, "step": top["step"], "phase": top["phase"], "unit": top["unit"],
                     "bytes": dict(top["bytes"])},
            "category_peak": {c: max(s["bytes"].get(c, 0) for s in samples) for c in cats},
            "process": {"rss": in_memory_total(held) + 210 * MiB, "peak_rss": total + 230 * MiB,
                        "device_allocated": 0, "device_peak": 0, "device_reserved": 0, "device_peak_reserved": 0},
            "phases": phases, "timeline": samples if timeline else [],
        })
    est = None
    if estimate:
        eb = {c: int(v * MiB * scale) for c, v in (("params", 40), ("params_gathered", 10), ("grads", 40),
                                                   ("optimizer_state", 80), ("activations", 110), ("buffers", 1))}
        eb.update({"offload_host": int(120 * MiB * scale)} if offload else {})
        est = {"world_size": ranks, "bytes": eb, "peak_total": in_memory_total(eb), "notes": ["activations: formula"]}
    return {"schema": "memsave.report/2",
            "run": {"name": name, "profile": "zero2", "world_size": ranks, "device": "cpu", "model": "GPT tiny",
                    "num_params": 10_000_000, "created": "2026-11-22T14:00:00+00:00"},
            "categories": cats, "ranks": out, "estimate": est}


# -- schema ----------------------------------------------------------------------------------------------------
def test_vocabulary_matches_the_enums() -> None:
    assert CATEGORIES == tuple(c.value for c in MemoryCategory)
    assert set(PHASES) == {p.value for p in Phase}
    assert set(OFF_DEVICE) < set(CATEGORIES)


def test_synthetic_reports_are_valid_and_round_trip(tmp_path: Path) -> None:
    for rep in (make_report("a"), make_report("b", timeline=False, estimate=False, offload=False, ranks=1)):
        validate_report(rep)
        before = copy.deepcopy(rep)
        save_report(rep, tmp_path / "sub" / "r.json")
        assert load_report(tmp_path / "sub" / "r.json") == before == rep
    assert len(make_report("a")["ranks"][1]["timeline"]) == 30


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets ``path`` ("ranks.1.timeline.3.phase") to ``value`` (``...`` deletes the key)."""
    def apply(data: dict[str, Any]) -> None:
        *head, last = path.split(".")
        obj: Any = data
        for key in head:
            obj = obj[int(key)] if key.isdigit() else obj[key]
        if value is ...:
            del obj[last]
        else:
            obj[int(last) if last.isdigit() else last] = value
    return apply


@pytest.mark.parametrize(("mutate", "message"), [
    (_set("ranks.1.timeline.3.phase", "fwd"), "report.ranks[1].timeline[3].phase = 'fwd' is not allowed; "
                                              "expected one of forward, backward, optimizer, idle"),
    (_set("ranks.0.current.params", -1), "report.ranks[0].current.params = -1 is not allowed; expected an integer >= 0"),
    (_set("ranks.0.current.params", 1.5), "report.ranks[0].current.params = 1.5 is not allowed"),
    (_set("ranks.0.process.rss", True), "report.ranks[0].process.rss = True is not allowed"),
    (_set("ranks.0.peak.bytes.weights", 4), "report.ranks[0].peak.bytes.weights is not allowed; expected one of "
                                            "report.categories: params, params_gathered"),
    (_set("ranks.0.current.offload_disk", 4), "report.ranks[0].current.offload_disk is not allowed"),
    (_set("extra", 1), "report.extra is not allowed (unknown key); expected only schema, run"),
    (_set("run.device", ...), "report.run.device is missing"),
    (_set("run.device", "tpu"), "report.run.device = 'tpu' is not allowed; expected one of cpu, cuda"),
    (_set("run.created", "yesterday"), "report.run.created = 'yesterday' is not allowed; expected an ISO 8601"),
    (_set("run.world_size", 0), "report.run.world_size = 0 is not allowed; expected an integer >= 1"),
    (_set("schema", "memsave.report/3"), "report.schema = 'memsave.report/3' is not allowed; expected 'memsave.report/2'"),
    (_set("categories.1", "gradz"), "report.categories[1] = 'gradz' is not allowed; expected one of params,"),
    (_set("categories.1", "params"), "report.categories[1] = 'params' is not allowed; expected each category once"),
    (_set("ranks.1.rank", 0), "report.ranks[1].rank = 0 is not allowed; expected each rank once"),
    (_set("ranks.1.rank", 2), "report.ranks[1].rank = 2 is not allowed; expected a rank below report.run.world_size = 2"),
    (_set("ranks", []), "report.ranks = [] is not allowed; expected at least one rank"),
    (_set("ranks.0.timeline.5.t", 0.001), "report.ranks[0].timeline[5].t = 0.001 is not allowed; expected seconds >= 0.05"),
    (_set("ranks.0.timeline.2.unit", 3), "report.ranks[0].timeline[2].unit = 3 is not allowed; expected a string or null"),
    (_set("ranks.0.peak.total", 1), "report.ranks[0].peak.total = 1 is not allowed; expected the in-memory sum"),
    (_set("ranks.1.category_peak.activations", MiB), "report.ranks[1].category_peak.activations = 1048576 is not "
     "allowed; expected at least the bytes at the peak sample, report.ranks[1].peak.bytes.activations = 100663296"),
    (_set("ranks.0.phases.warmup", {"peak_total": 0, "bytes": {}}), "report.ranks[0].phases key = 'warmup'"),
    (_set("estimate.notes", [3]), "report.estimate.notes[0] = 3 is not allowed; expected a string"),
    (_set("estimate.peak_total", ...), "report.estimate.peak_total is missing"),
])
def test_bad_reports_are_rejected_naming_the_field(mutate: Callable[[dict[str, Any]], None], message: str,
                                                   tmp_path: Path) -> None:
    data = make_report("bad")
    mutate(data)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_report(data)
    with pytest.raises(ValueError, match=re.escape(message)):
        save_report(data, tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'r.json'}: {message}")):
        load_report(tmp_path / "r.json")


def _v1(ranks: list[dict[str, Any]], profile: str) -> dict[str, Any]:
    """What ``MemoryReport.to_dict()`` wrote before the tracker (``memsave.report/1``)."""
    return {"schema": "memsave.report/1", "profile": profile, "ranks": ranks}


def test_load_converts_v1_and_refuses_what_is_not_a_report(tmp_path: Path) -> None:
    v1 = _v1([{"rank": r, "bytes": {"grads": 10 * MiB, "params": 20 * MiB}, "rss": 500 * MiB,
                "peak_rss": 600 * MiB, "device_allocated": 0, "device_peak": 0} for r in range(2)], "zero2")
    (tmp_path / "old.json").write_text(json.dumps(v1))
    data = load_report(tmp_path / "old.json")
    validate_report(data)
    assert data["run"]["name"] == "old" and data["run"]["profile"] == "zero2" and data["run"]["world_size"] == 2
    assert data["categories"] == ["params", "grads"] and data["estimate"] is None
    r1 = data["ranks"][1]
    assert r1["timeline"] == [] and r1["current"] == r1["peak"]["bytes"] == {"grads": 10 * MiB, "params": 20 * MiB}
    assert r1["peak"]["total"] == 30 * MiB and r1["process"]["peak_rss"] == 600 * MiB
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"junk\.json is not a memsave report: not JSON"):
        load_report(tmp_path / "junk.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match=r"report = \[\] is not allowed; expected an object"):
        load_report(tmp_path / "list.json")


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_text_table() -> None:
    text = format_text(make_report("a"))
    assert text.startswith("memory report a (zero2): 2 rank(s) on cpu, GPT tiny 10,000,000 parameters")
    assert "optimizer_state" in text and "offload_host" in text and "unaccounted" in text
    assert "rank 1 peak 239.0 MiB at step 0, backward, unit blocks.0" in text and "note: activations" in text


def test_text_shows_the_categories_at_the_peak_apart_from_their_maxima() -> None:
    """"at peak": each category at the peak sample, summing to the peak; "max over run": each category's own
    maximum (no total: they fall at different times). Here they differ: the peak is in backward, with fewer
    activations than the end of forward and fewer gradients than the optimizer step."""
    rep = make_report("a")
    lines = format_text(rep).splitlines()
    head = _cells(lines[1])
    cats = rep["categories"]
    assert head[:len(cats) + 2] == ["rank", *cats, "in memory"]
    for r in rep["ranks"]:
        at = next(i for i, ln in enumerate(lines) if _cells(ln)[:2] == [str(r["rank"]), "now"]) + 1
        at_peak, max_run = _cells(lines[at]), _cells(lines[at + 1])
        assert at_peak[0] == "at peak" and max_run[0] == "max over run"
        peak = r["peak"]
        assert sum(peak["bytes"].get(c, 0) for c in _on_device(rep)) == peak["total"]
        assert at_peak[1:len(cats) + 2] == [*(format_bytes(peak["bytes"].get(c, 0)) for c in cats),
                                            format_bytes(peak["total"])]
        assert max_run[1:] == [format_bytes(r["category_peak"].get(c, 0)) for c in cats]  # and no total
        assert all(r["category_peak"].get(c, 0) >= peak["bytes"].get(c, 0) for c in cats)
        assert r["category_peak"]["activations"] > peak["bytes"]["activations"]
        assert r["category_peak"]["grads"] > peak["bytes"]["grads"]
    assert any(ln.startswith("at peak: each category at the peak sample (they sum to its in-memory total)")
               for ln in lines)
    # tracked without a timeline (timeline=False): the same rows, no zoomed step
    lean = format_text(make_report("p", timeline=False, estimate=False))
    assert "at peak" in lean and "max over run" in lean and " by phase " not in lean
    # without a tracker there is no peak but the current sample: no "at peak" / "max over run" rows
    plain = make_report("p", timeline=False, estimate=False)
    for r in plain["ranks"]:
        r.update(phases={}, category_peak=dict(r["current"]),
                 peak={"total": in_memory_total(r["current"]), "step": 0, "phase": "idle", "unit": None,
                       "bytes": dict(r["current"])})
    validate_report(plain)
    text = format_text(plain)
    assert "at peak" not in text and "max over run" not in text and " now " in text


def test_peak_step_finds_the_step_holding_the_peak_phase_by_phase() -> None:
    rep = make_report("a")
    r = rep["ranks"][0]
    r["peak"]["step"] = 1  # both steps reach the peak; the tracker keeps the first, this report says step 1
    view = peak_step(r)
    assert view is not None and view["step"] == 1 and view["holds_peak"]
    tl = r["timeline"]
    assert view["samples"] == [i for i, s in enumerate(tl) if s["step"] == 1] == list(range(15, 30))
    assert [(p["phase"], p["repeat"], len(p["samples"])) for p in view["phases"]] == [(ph, 1, n) for ph, n in STEPS]
    assert in_memory_total(tl[view["peak"]]["bytes"]) == r["peak"]["total"]
    for p in view["phases"]:  # each phase's peak is its largest sample, the first of equals
        totals = [in_memory_total(tl[i]["bytes"]) for i in p["samples"]]
        assert p["peak"] == p["samples"][totals.index(max(totals))]
    # gradient accumulation: forward and backward once per micro-batch, numbered
    acc = copy.deepcopy(r)
    acc["timeline"] = [dict(s, step=3) for s in tl[:11]] + [dict(s, step=3) for s in tl[:15]]
    acc["peak"]["step"] = 3
    phases = [(p["phase"], p["repeat"]) for p in peak_step(acc)["phases"]]  # type: ignore[index]
    assert phases == [("forward", 1), ("backward", 1), ("forward", 2), ("backward", 2), ("optimizer", 1), ("idle", 1)]
    # a peak whose step has no sample (an edited timeline): the step of the largest sample, not holding the peak
    lost = copy.deepcopy(r)
    lost["peak"]["step"], lost["peak"]["total"] = 7, lost["peak"]["total"] + 1
    view = peak_step(lost)
    assert view is not None and view["step"] == 0 and not view["holds_peak"]
    assert peak_step(make_report("p", timeline=False)["ranks"][0]) is None


def _columns(head: str, line: str, names: list[str], left: int) -> list[str]:
    """The cells of ``line`` under the columns ``names`` of the header ``head``: the first ``left`` columns are
    left-aligned (a cell starts where its name does), the others right-aligned (it ends where its name does)."""
    starts, pos = [], 0
    for name in names:
        pos = head.index(name, pos)
        starts.append(pos)
        pos += len(name)
    cells = [line[starts[i]:starts[i + 1]].strip() for i in range(left - 1)]
    cells.append(line[starts[left - 1]:].split("  ")[0])  # the last left-aligned cell may be wider than its name
    pos = starts[left - 1] + len(cells[-1])
    for start, name in zip(starts[left:], names[left:]):
        cells.append(line[pos:start + len(name)].strip())
        pos = start + len(name)
    return [*cells, line[pos:].strip()]  # and what follows the last column


def test_text_zooms_into_the_step_holding_the_peak() -> None:
    """Per rank, the step holding the peak phase by phase: each phase's first sample and largest, in the step's
    order, by category; the rank's peak marked, equal to the report's."""
    rep = make_report("a")
    cats = rep["categories"]
    r = rep["ranks"][1]
    tl = r["timeline"]
    for k, s in enumerate(tl):  # make forward's start and peak two rows, and backward's peak its last sample
        if s["step"] == 0 and s["phase"] == "backward":
            s["bytes"]["grads"] = (k + 1) * 100 * MiB
    r["category_peak"]["grads"] = max(s["bytes"].get("grads", 0) for s in tl)
    top = max(tl, key=lambda s: in_memory_total(s["bytes"]))
    r["peak"] = {"total": in_memory_total(top["bytes"]), "step": 0, "phase": top["phase"], "unit": top["unit"],
                 "bytes": dict(top["bytes"])}
    validate_report(rep)
    view = peak_step(r)
    assert view is not None and view["holds_peak"] and tl[view["peak"]] is top and top["event"] == "post_backward"
    lines = format_text(rep).splitlines()
    first = lines.index(next(ln for ln in lines if ln.startswith("rank 1 step 0 by phase")))
    assert "(the step holding the peak): forward -> backward -> optimizer -> idle" in lines[first]
    names = ["phase", "sample", "event", "unit", *cats, "in memory"]
    head = lines[first + 1]
    rows = [_columns(head, ln, names, 4) for ln in lines[first + 2:first + 2 + 6]]
    assert [row[:2] for row in rows] == [["forward", "start"], ["", "peak"], ["backward", "start"], ["", "peak"],
                                         ["optimizer", "start, peak"], ["idle", "start, peak"]]
    assert not lines[first + 8].startswith("  ")  # the table ends there
    expected = [i for run in view["phases"] for i in dict.fromkeys([run["samples"][0], run["peak"]])]
    for row, i in zip(rows, expected, strict=True):
        s = tl[i]
        assert row[2:4] == [s["event"], s["unit"] or ""]
        assert row[4:-1] == [*(format_bytes(s["bytes"].get(c, 0)) for c in cats), format_bytes(in_memory_total(s["bytes"]))]
    assert [row[-1] for row in rows] == ["", "", "", "<- the rank's peak", "", ""]
    assert rows[3][-2] == format_bytes(r["peak"]["total"]) and rows[3][3] == r["peak"]["unit"] == "blocks.5"


# -- the page ----------------------------------------------------------------------------------------------------
def test_page_is_self_contained_and_escapes_what_it_embeds() -> None:
    evil = make_report("</script><script>alert(1)</script>", timeline=False)
    page = render_html([make_report("a"), evil], title="<b>t</b>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<link" not in page and "<script src" not in page and "@import" not in page
    assert page.lower().count("</script") == 4  # the data, the zoomed steps, the error handler, the drawing script
    assert "<title>&lt;b&gt;t&lt;/b&gt;</title>" in page and "<script>alert(1)" not in page
    with pytest.raises(ValueError, match=r"reports\[1\]\.run\.device = 'tpu'"):
        render_html([make_report("a"), {**evil, "run": {**evil["run"], "device": "tpu"}}])


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CONSOLE = re.compile(r":CONSOLE\b")  # [pid:tid:time:INFO:CONSOLE:12] "message", source: file:///... (12)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (.ci/run installs it)")


class _Dom(HTMLParser):
    """The dumped DOM: body attributes, and per <svg> its aria-label, every element inside it and its texts."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.body: dict[str, str | None] = {}
        self.svgs: list[tuple[str, list[tuple[str, dict[str, str | None]]]]] = []
        self.texts: list[str] = []
        self.svg_texts: dict[str, list[str]] = {}
        self._in_svg = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = a
        elif tag == "svg":
            self.svgs.append((a.get("aria-label") or "", []))
            self.svg_texts.setdefault(self.svgs[-1][0], [])
            self._in_svg = True
        elif self._in_svg:
            self.svgs[-1][1].append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        self._in_svg = self._in_svg and tag != "svg"

    def handle_data(self, data: str) -> None:
        self.texts.append(data)
        if self._in_svg:
            self.svg_texts[self.svgs[-1][0]].append(data)

    def count(self, label: str, tag: str, cls: str) -> list[int]:
        """Per svg labelled ``label``: how many ``tag`` elements carry the class ``cls``."""
        return [sum(1 for t, a in els if t == tag and cls in (a.get("class") or "").split())
                for lab, els in self.svgs if lab == label]


def _open(page: str, tmp_path: Path, name: str) -> tuple[_Dom, list[str]]:
    """One headless Chromium launch: the DOM after the scripts ran, and the console lines it logged."""
    assert CHROMIUM is not None
    path = tmp_path / f"{name}.html"
    path.write_text(page, encoding="utf-8")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / f'chromium-{name}'}", "--enable-logging=stderr", "--v=0",
           "--virtual-time-budget=5000", "--dump-dom", path.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "<body" in proc.stdout, proc.stderr[-3000:]
    return _Dom(proc.stdout), [line for line in proc.stderr.splitlines() if CONSOLE.search(line)]


def peak_label(p: dict[str, Any]) -> str:
    return f"peak {format_bytes(p['total'])} \u00b7 step {p['step']} \u00b7 {p['phase']} \u00b7 {p['unit']}"


def _on_device(rep: dict[str, Any]) -> list[str]:
    return [c for c in rep["categories"] if c not in OFF_DEVICE]


@needs_chromium
def test_page_renders_timelines_bars_and_tables(tmp_path: Path) -> None:
    rep = make_report("zero2-a")
    dom, console = _open(render_html([rep]), tmp_path, "one")
    assert console == [] and "data-error" not in dom.body
    assert dom.body.get("data-rendered") == str(expected_charts([rep])) == "5"
    for rank in (0, 1):
        label = f"memory timeline of rank {rank}"
        assert dom.count(label, "path", "area") == [len(_on_device(rep))]  # one stacked area per category
        assert dom.count(label, "g", "peak-marker") == [1]
        assert dom.count(label, "rect", "hover-col") == [30]
        assert dom.count(label, "polyline", "rss-line") == [1] and dom.count(label, "polyline", "offload-line") == [1]
        assert dom.count(label, "line", "estimate-line") == [1] and dom.count(label, "text", "rss-tick") == [0]
        bands = {a.get("data-phase") for t, a in dict(dom.svgs)[label] if "phase-band" in (a.get("class") or "")}
        assert bands == set(PHASES)
    assert peak_label(rep["ranks"][0]["peak"]) in dom.texts
    # bars: each rank's peak sample and the estimate, one rect per non-zero category
    segments = sum(1 for r in rep["ranks"] for c in _on_device(rep) if r["peak"]["bytes"].get(c, 0))
    segments += sum(1 for c in _on_device(rep) if rep["estimate"]["bytes"].get(c, 0))
    assert dom.count("peak memory per rank", "rect", "bar") == [segments + 3]  # + 3 off-device offload_host bars
    assert "unaccounted (RSS \u2212 accounted)" in dom.texts and "rank 1" in dom.texts
    assert dom.texts.count("at peak") == dom.texts.count("max over run") == 2  # one column each per rank


@needs_chromium
def test_page_zooms_into_the_step_holding_the_peak(tmp_path: Path) -> None:
    """Per rank a second chart: the samples of the step holding the peak, a band per phase in the step's order,
    named, the peak marked with the run's peak; the step outlined on the whole-run chart; and its phase table."""
    rep = make_report("zoom")
    dom, console = _open(render_html([rep]), tmp_path, "zoom")
    assert console == [] and "data-error" not in dom.body
    svgs = dict(dom.svgs)
    for r in rep["ranks"]:
        view = peak_step(r)
        assert view is not None and view["holds_peak"]
        label = f"memory in step {view['step']} of rank {r['rank']}, by phase"
        assert dom.count(label, "rect", "hover-col") == [len(view["samples"])] == [15]
        assert dom.count(label, "path", "area") == [len(_on_device(rep))] and dom.count(label, "g", "peak-marker") == [1]
        bands = [a.get("data-phase") for t, a in svgs[label] if "phase-band" in (a.get("class") or "")]
        assert bands == [ph for ph, _ in STEPS] == [p["phase"] for p in view["phases"]]
        assert dom.count(label, "text", "phase-label") == [len(STEPS)]
        assert dom.count(label, "line", "step-line") == [0]
        assert dom.count(f"memory timeline of rank {r['rank']}", "rect", "zoom-span") == [1]
        assert f"rank {r['rank']}: step {view['step']} zoomed in, by phase (the step holding the peak)" in dom.texts
        # the zoomed step's peak is the run's peak: the same label on both charts of the rank
        assert peak_label(r["peak"]) in dom.svg_texts[label]
        assert peak_label(r["peak"]) in dom.svg_texts[f"memory timeline of rank {r['rank']}"]
        assert [t for t in dom.svg_texts[label] if t in PHASES] == [ph for ph, _ in STEPS]  # named in order
    # the phase tables: each phase at its first sample and its largest, one row when they are the same sample
    rows = [at for r in rep["ranks"] for run in peak_step(r)["phases"]  # type: ignore[index]
            for at in (["start", "peak"] if run["peak"] != run["samples"][0] else ["start, peak"])]
    assert dom.texts.count("start") == rows.count("start") == 2 and dom.texts.count("start, peak") == 6
    assert dom.texts.count("\u2190 the rank's peak") == 2  # the row holding it, marked


@needs_chromium
def test_page_without_timeline_still_draws_bars_and_table(tmp_path: Path) -> None:
    rep = make_report("plain", timeline=False, estimate=False, offload=False, ranks=1)
    dom, console = _open(render_html([rep]), tmp_path, "plain")
    assert console == [] and "data-error" not in dom.body and dom.body.get("data-rendered") == "1"
    assert [lab for lab, _ in dom.svgs] == ["peak memory per rank"]
    assert dom.count("peak memory per rank", "rect", "bar") == [len(rep["ranks"][0]["peak"]["bytes"])]
    assert "No timeline: this report was taken without a memory tracker." in dom.texts


@needs_chromium
def test_page_edge_cases_cuda_one_sample_unsampled_peak_long_timeline(tmp_path: Path) -> None:
    rep = make_report("edge")
    rep["run"]["device"] = "cuda"
    rep["categories"].append("master")  # listed, never held: an empty area
    r0, r1 = rep["ranks"]
    # one sample, below the peak, with an RSS that needs its own axis
    r0["timeline"] = [{**r0["timeline"][3], "device_allocated": 300 * MiB, "rss": 4096 * MiB}]
    # 1500 samples: drawn as the largest of every 3 (500 columns), the peak among them
    r1["timeline"] = [{**s, "t": s["t"] + k, "step": s["step"] + 2 * k} for k in range(50) for s in r1["timeline"]]
    dom, console = _open(render_html([rep]), tmp_path, "edge")
    assert console == [] and "data-error" not in dom.body and dom.body.get("data-rendered") == "5"
    label = "memory timeline of rank 0"
    assert dom.count(label, "path", "area") == [len(_on_device(rep))] and dom.count(label, "g", "peak-marker") == [1]
    assert dom.count(label, "polyline", "device-line") == [1] and dom.count(label, "text", "rss-tick")[0] >= 3
    assert any("(sampled; report peak 239.0 MiB)" in t for t in dom.texts)
    assert "unaccounted (allocated \u2212 accounted)" in dom.texts and "peak reserved" in dom.texts
    assert dom.count("memory timeline of rank 1", "rect", "hover-col") == [500]
    assert f"{peak_label(r1['peak'])}" in dom.texts and any("500 shown, the largest of every 3 of 1500" in t for t in dom.texts)


@needs_chromium
def test_comparison_of_three_runs(tmp_path: Path) -> None:
    reps = [make_report("zero2"), make_report("</script><b>x", timeline=False, estimate=False, ranks=1),
            make_report("zero3", scale=0.5, ranks=4)]
    dom, console = _open(render_html(reps), tmp_path, "cmp")
    assert console == [] and "data-error" not in dom.body
    assert dom.body.get("data-rendered") == str(expected_charts(reps)) == str(1 + 3 + 2 * (2 + 4))
    assert len(dom.count("memory timeline of rank 0", "g", "peak-marker")) == 2  # runs 1 and 3
    measured = sum(1 for rep in reps for c in _on_device(rep) if max(
        (r["peak"] for r in rep["ranks"]), key=lambda p: p["total"])["bytes"].get(c, 0))
    estimated = sum(1 for rep in reps if rep["estimate"] for c in _on_device(rep) if rep["estimate"]["bytes"].get(c, 0))
    bars = dom.count("peak memory of each run", "rect", "bar")
    assert bars == [measured + estimated + 5]  # offload_host beside 3 measured and 2 estimated bars
    assert dom.count("peak memory of each run", "rect", "estimate") == [estimated]
    assert "</script><b>x" in dom.texts  # the run name is text, not markup


@needs_chromium
def test_console_check_catches_console_error_and_uncaught_exceptions(tmp_path: Path) -> None:
    rep = make_report("broken")
    page = render_html([rep])
    # console.error alone: the charts are fine, only the console line tells
    dom, console = _open(page.replace('"use strict";', '"use strict"; console.error("deliberate");', 1), tmp_path, "log")
    assert dom.body.get("data-rendered") == "5" and "data-error" not in dom.body
    assert len(console) == 1 and "deliberate" in console[0]
    # an uncaught exception before anything is drawn: data-error, no data-rendered, an "Uncaught" console line
    broken = page.replace("var reports = JSON.parse(", "var reports = JSON.parse('{' + ", 1)
    dom, console = _open(broken, tmp_path, "throw")
    assert "data-rendered" not in dom.body and "SyntaxError" in (dom.body.get("data-error") or "")
    assert any("Uncaught SyntaxError" in line for line in console), console
    # an error inside one chart: that chart is reported in the page and data-error, the others are drawn
    dom, console = _open(page.replace("drawTimeline(sec, rep, r, null, view)", "drawTimeline(sec, rep, null, null, view)", 1),
                         tmp_path, "chart")
    assert dom.body.get("data-rendered") == "3" and "rank 0 timeline: TypeError" in (dom.body.get("data-error") or "")


# -- memsave report ----------------------------------------------------------------------------------------------
def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_report(make_report("a"), tmp_path / "a.json")
    v1 = _v1([{"rank": 0, "bytes": {"params": MiB}, "rss": 9 * MiB, "peak_rss": 9 * MiB}], "ddp")
    (tmp_path / "old.json").write_text(json.dumps(v1))
    assert main(["report", str(tmp_path / "a.json"), str(tmp_path / "old.json"), "--html", str(tmp_path / "o.html")]) == 0
    out = capsys.readouterr().out
    assert "HTML report (2 runs) written to" in out and "memory report" not in out  # --html alone: no table
    page = (tmp_path / "o.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and '"name":"old"' in page
    assert main(["report", str(tmp_path / "old.json"), "--json", str(tmp_path / "v2.json"), "--text"]) == 0
    assert "memory report old (ddp): 1 rank(s) on cpu" in capsys.readouterr().out
    assert load_report(tmp_path / "v2.json")["schema"] == "memsave.report/2"
    assert main(["report", str(tmp_path / "a.json")]) == 0
    assert "memory report a (zero2)" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "needle"), [
    (["missing.json"], "missing.json: no such file"),
    (["a.json", "a.json", "--json", "x.json"], "--json writes one report; 2 files were given"),
    (["bad.json"], "bad.json: report.run.device = 'tpu' is not allowed"),
])
def test_cli_report_errors_exit_2(argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    save_report(make_report("a"), tmp_path / "a.json")
    bad = make_report("bad")
    bad["run"]["device"] = "tpu"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    monkeypatch.chdir(tmp_path)
    assert main(["report", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memsave report: error: ") and needle in err
