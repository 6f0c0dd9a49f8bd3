"""One self-contained HTML page for one or more ``memsave.report/2`` reports.

The page has no external resource: the reports are embedded as JSON in a ``<script type="application/json">``
tag, and the CSS and the vanilla JS that draws them as inline SVG (``report.css``, ``report.js``, package
data next to this module) are inlined, so the file works offline and can be attached to an issue. Views: per
run, the peak per rank by category (bars, beside the estimate), per rank the memory timeline (stacked areas by
category, phase bands, the peak marked, RSS and the estimated peak as lines), then the step holding the peak
zoomed in (the same chart over that step's samples, each phase band named, and a table of each phase's start
and peak by category), and a table of current / at-peak / max-over-run / estimated bytes with the process
figures; with several runs, a comparison of their peaks first. The zoomed step is chosen here, by
:func:`~memsave.memory.schema.peak_step` (the one definition the text report uses too), and embedded beside
the reports.

The script sets ``<body data-rendered="N">`` (N = charts drawn) when it is done and writes any error into
``<body data-error>`` and into the page, so a headless browser can check the page (tests/test_report_html.py).
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from memsave.memory.schema import peak_step, validate_report

__all__ = ["expected_charts", "render_html", "write_html"]

# A separate script before the page's own, so that even a syntax error in report.js is shown and recorded.
_ON_ERROR = """window.onerror = function (msg, src, line) {
  var b = document.body, p = document.getElementById("page-error");
  b.dataset.error = (b.dataset.error ? b.dataset.error + "\\n" : "") + msg + " (" + src + ":" + line + ")";
  p.hidden = false; p.textContent = b.dataset.error;
};
window.addEventListener("unhandledrejection", function (e) { window.onerror(String(e.reason), "promise", 0); });"""


def _asset(name: str) -> str:
    text = resources.files("memsave.memory").joinpath(name).read_text(encoding="utf-8")
    # [Note: inlined assets] the page inlines these files: a closing tag inside would end the element early
    assert "</script" not in text.lower() and "</style" not in text.lower(), f"{name} holds a closing tag"
    return text


def _json_for_script(data: Any) -> str:
    """JSON that cannot end its ``<script>`` element or open a comment: ``<``, ``>``, ``&`` as escapes."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def expected_charts(reports: Sequence[Mapping[str, Any]]) -> int:
    """How many charts the page draws: per run one bar chart, and per rank that has samples its timeline and
    its peak step; plus the comparison when there are several runs (what ``body[data-rendered]`` says once the
    page is drawn)."""
    timelines = sum(1 for rep in reports for rank in rep["ranks"] if rank["timeline"])
    return len(reports) + 2 * timelines + (1 if len(reports) > 1 else 0)


def render_html(reports: Sequence[Mapping[str, Any]], *, title: str = "memsave memory report") -> str:
    """The page for ``reports`` (each validated first; a bad one raises ``ValueError`` naming the field)."""
    if not reports:
        raise ValueError("render_html needs at least one report")
    for i, rep in enumerate(reports):
        validate_report(rep, where=f"reports[{i}]" if len(reports) > 1 else "report")
    runs = ", ".join(str(rep["run"]["name"]) for rep in reports)
    steps = [[peak_step(rank) for rank in rep["ranks"]] for rep in reports]  # per run, per rank (in its order)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="memsave">
<title>{html.escape(title)}</title>
<style>
{_asset("report.css")}</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="meta">{len(reports)} run(s): {html.escape(runs)}. Sizes in binary units (1 MiB = 2<sup>20</sup> bytes);
hover a chart for the figures. Stacked: memory on the device (or in host RAM on CPU); offload_host and offload_disk
live on another tier and are drawn beside, not stacked.</p>
<pre id="page-error" hidden></pre>
<main id="report"></main>
<script type="application/json" id="report-data">{_json_for_script(list(reports))}</script>
<script type="application/json" id="step-data">{_json_for_script(steps)}</script>
<script>
{_ON_ERROR}
</script>
<script>
{_asset("report.js")}</script>
</body>
</html>
"""


def write_html(reports: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *,
               title: str = "memsave memory report") -> None:
    """Render ``reports`` and write the page to ``path`` (parent folders are made)."""
    page = render_html(reports, title=title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
