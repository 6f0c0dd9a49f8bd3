// memsave memory report page: draws memsave.report/2 data (embedded as JSON) as inline SVG. No libraries,
// no network. After drawing, body[data-rendered] = the number of charts drawn; an error in a chart is shown in
// the page and in body[data-error] (the inline handler before this script catches uncaught ones).
"use strict";
(function () {
  var NS = "http://www.w3.org/2000/svg";
  var COLORS = {
    params: "#4e79a7", params_gathered: "#a0cbe8", grads: "#f28e2b", master: "#ffbe7d",
    optimizer_state: "#59a14f", activations: "#e15759", buffers: "#b07aa1", comm: "#9c755f",
    offload_host: "#76b7b2", offload_disk: "#bab0ac"
  };
  var OFF_DEVICE = ["offload_host", "offload_disk"];
  var PHASES = ["forward", "backward", "optimizer", "idle"];
  var W = 960, H = 320, M = { l: 78, r: 70, t: 22, b: 46 };

  function fmt(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, sign = n < 0 ? "-" : "";
    n = Math.abs(n);
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return sign + (i === 0 ? String(Math.round(n)) : n.toFixed(1)) + " " + units[i];
  }
  function el(tag, attrs, parent, text) {
    var svg = ["svg", "g", "path", "rect", "line", "polyline", "circle", "text", "title"].indexOf(tag) >= 0;
    var node = svg ? document.createElementNS(NS, tag) : document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function tip(node, text) { el("title", {}, node, text); return node; }
  function get(bytes, cat) { return (bytes && bytes[cat]) || 0; }
  function onDevice(cats) { return cats.filter(function (c) { return OFF_DEVICE.indexOf(c) < 0; }); }
  function offDevice(cats) { return cats.filter(function (c) { return OFF_DEVICE.indexOf(c) >= 0; }); }
  function total(bytes, cats) { return onDevice(cats).reduce(function (s, c) { return s + get(bytes, c); }, 0); }
  function breakdown(bytes, cats) {
    return cats.filter(function (c) { return get(bytes, c) > 0; })
      .map(function (c) { return "  " + c + ": " + fmt(get(bytes, c)); }).join("\n");
  }
  function peakLabel(p) {
    return "peak " + fmt(p.total) + " \u00b7 step " + p.step + " \u00b7 " + p.phase + (p.unit ? " \u00b7 " + p.unit : "");
  }
  // y axis: ticks at a round number of the largest binary unit below the maximum
  function yScale(max) {
    max = Math.max(max, 1024);  // an empty chart still gets whole-byte ticks
    var unit = 1; while (max / unit >= 1024) unit *= 1024;
    var raw = max / unit / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 2.5, 5, 10].map(function (f) { return f * mag; }).filter(function (s) { return s >= raw; })[0] * unit;
    var top = Math.ceil(max / step) * step, ticks = [];
    for (var v = 0; v <= top + step / 2; v += step) ticks.push(v);
    return { top: top, ticks: ticks, y: function (b) { return M.t + (H - M.t - M.b) * (1 - b / top); } };
  }
  function axes(svg, ys, yLabel) {
    ys.ticks.forEach(function (v) {
      el("line", { x1: M.l, x2: W - M.r, y1: ys.y(v), y2: ys.y(v), class: "grid" }, svg);
      el("text", { x: M.l - 6, y: ys.y(v) + 4, class: "tick", "text-anchor": "end" }, svg, fmt(v));
    });
    el("text", { x: 14, y: M.t + (H - M.t - M.b) / 2, class: "axis-label", transform: "rotate(-90 14 " +
      (M.t + (H - M.t - M.b) / 2) + ")", "text-anchor": "middle" }, svg, yLabel);
  }
  function newSvg(parent, label) {
    return el("svg", { viewBox: "0 0 " + W + " " + H, class: "chart", role: "img", "aria-label": label }, parent);
  }

  // a long timeline drawn sample by sample is a grey blur: keep the largest sample (in-memory total) of each run
  // of consecutive ones, about 600 in all, so every peak, the overall peak included, stays on the chart
  function thinning(tl) { return tl.length <= 1200 ? 1 : Math.ceil(tl.length / 600); }
  function thin(tl, cats) {
    var every = thinning(tl), out = [];
    if (every === 1) return tl;
    for (var i = 0; i < tl.length; i += every) {
      var best = tl[i];
      for (var k = i + 1; k < Math.min(i + every, tl.length); k++) if (total(tl[k].bytes, cats) > total(best.bytes, cats)) best = tl[k];
      out.push(best);
    }
    return out;
  }

  // (a) one rank's memory over its samples: stacked areas by category, phase bands, peak, RSS and estimate lines.
  // view null: the whole timeline (thinned when long, step boundaries, the zoomed step outlined: zoomed);
  // view = the step holding the peak (peak_step in schema.py, indices into the timeline): its samples, phases named
  function drawTimeline(parent, report, rank, view, zoomed) {
    var cats = report.categories, stack = onDevice(cats);
    var all = view ? view.samples.map(function (i) { return rank.timeline[i]; }) : rank.timeline;
    var tl = thin(all, cats), n = tl.length;
    var est = report.estimate, cuda = report.run.device === "cuda";
    var svg = newSvg(parent, view ? stepLabel(rank, view) : "memory timeline of rank " + rank.rank);
    var max = Math.max(rank.peak.total, est ? est.peak_total : 0);
    tl.forEach(function (s) {
      max = Math.max(max, total(s.bytes, cats), s.device_allocated);
      offDevice(cats).forEach(function (c) { max = Math.max(max, get(s.bytes, c)); });
    });
    // RSS far above what is accounted (on CPU: the libraries, the allocator's cache) would flatten the stack
    // to nothing: then RSS gets its own axis on the right, said in the axis label
    var rssMax = Math.max.apply(null, tl.map(function (s) { return s.rss; }));
    var split = rssMax > 3 * max, ys = yScale(split ? max : Math.max(max, rssMax)), yr = split ? yScale(rssMax) : ys;
    var span = Math.max(n - 1, 1);
    var x = function (i) { return M.l + (W - M.l - M.r) * (n === 1 ? 0.5 : i / span); };
    var half = (W - M.l - M.r) / span / 2;
    // phase bands: one rectangle per run of consecutive samples in the same phase (named in a zoomed step, where
    // a phase met again, as under gradient accumulation, is numbered)
    var repeats = {}, names = [];
    for (var i = 0, j; i < n; i = j) {
      for (j = i; j < n && tl[j].phase === tl[i].phase; j++);
      var x0 = Math.max(M.l, x(i) - half), x1 = Math.min(W - M.r, x(j - 1) + half), ph = tl[i].phase;
      repeats[ph] = (repeats[ph] || 0) + 1;
      var name = ph + (repeats[ph] > 1 ? " " + repeats[ph] : "");
      tip(el("rect", { x: x0, y: M.t, width: Math.max(x1 - x0, 1), height: H - M.t - M.b,
        class: "phase-band phase-" + ph, "data-phase": ph }, svg), name + ", step " + tl[i].step);
      if (view) names.push({ name: name, x: (x0 + x1) / 2, width: x1 - x0 });
    }
    axes(svg, ys, cuda ? "device memory" : "memory");
    // stacked areas, bottom to top in the report's category order
    var base = tl.map(function () { return 0; });
    stack.forEach(function (c) {
      var top = tl.map(function (s, k) { return base[k] + get(s.bytes, c); });
      var pts = top.map(function (v, k) { return x(k) + "," + ys.y(v); });
      var low = base.map(function (v, k) { return x(k) + "," + ys.y(v); }).reverse();
      if (n === 1) { pts = [x(0) - half + "," + ys.y(top[0]), x(0) + half + "," + ys.y(top[0])];
        low = [x(0) + half + "," + ys.y(base[0]), x(0) - half + "," + ys.y(base[0])]; }
      tip(el("path", { d: "M" + pts.join("L") + "L" + low.join("L") + "Z", fill: COLORS[c],
        class: "area", "data-category": c }, svg), c);
      base = top;
    });
    function line(values, cls, color, label, scale) {
      var y = (scale || ys).y, pts = values.map(function (v, k) { return x(k) + "," + y(v); }).join(" ");
      if (n === 1) pts = (x(0) - half) + "," + y(values[0]) + " " + (x(0) + half) + "," + y(values[0]);
      tip(el("polyline", { points: pts, class: cls, stroke: color || "", fill: "none" }, svg), label);
    }
    line(tl.map(function (s) { return s.rss; }), "rss-line", "", "process RSS" + (split ? " (right axis)" : ""), yr);
    if (split) {
      yr.ticks.forEach(function (v) {
        el("text", { x: W - M.r + 6, y: yr.y(v) + 4, class: "tick rss-tick" }, svg, fmt(v));
      });
      el("text", { x: W - 8, y: M.t + (H - M.t - M.b) / 2, class: "axis-label", "text-anchor": "middle",
        transform: "rotate(90 " + (W - 8) + " " + (M.t + (H - M.t - M.b) / 2) + ")" }, svg, "process RSS (line)");
    }
    if (tl.some(function (s) { return s.device_allocated > 0; })) {
      line(tl.map(function (s) { return s.device_allocated; }), "device-line", "", "device allocated");
    }
    offDevice(cats).forEach(function (c) {
      line(tl.map(function (s) { return get(s.bytes, c); }), "offload-line", COLORS[c], c + " (not on the device)");
    });
    if (est) {
      el("line", { x1: M.l, x2: W - M.r, y1: ys.y(est.peak_total), y2: ys.y(est.peak_total), class: "estimate-line" }, svg);
      el("text", { x: W - M.r - 4, y: ys.y(est.peak_total) - 4, class: "line-label", "text-anchor": "end" }, svg,
        "estimate " + fmt(est.peak_total));
    }
    if (view) {
      // the phases named under the axis (the text only where its band is wide enough; the band's title always)
      names.forEach(function (p) {
        if (p.width >= 7 * p.name.length) {
          el("text", { x: p.x, y: H - M.b + 16, class: "phase-label", "text-anchor": "middle" }, svg, p.name);
        }
      });
    } else {
      // step boundaries on the x axis (on a long run, only those at least 60 px after the last one drawn)
      var lastX = -Infinity;
      tl.forEach(function (s, k) {
        if ((k > 0 && s.step === tl[k - 1].step) || x(k) - lastX < 60) return;
        lastX = x(k);
        el("line", { x1: x(k) - half, x2: x(k) - half, y1: M.t, y2: H - M.b + 6, class: "step-line" }, svg);
        el("text", { x: x(k) - half + 3, y: H - M.b + 16, class: "tick" }, svg, "step " + s.step);
      });
      // the step zoomed in below, outlined
      var inStep = [];
      tl.forEach(function (s, k) { if (zoomed && s.step === zoomed.step) inStep.push(k); });
      if (inStep.length) {
        var z0 = Math.max(M.l, x(inStep[0]) - half), z1 = Math.min(W - M.r, x(inStep[inStep.length - 1]) + half);
        tip(el("rect", { x: z0, y: M.t, width: Math.max(z1 - z0, 1), height: H - M.t - M.b, class: "zoom-span" }, svg),
          "step " + zoomed.step + ": zoomed in below");
      }
    }
    var span0 = all[0].t, span1 = all[all.length - 1].t;
    el("text", { x: (W + M.l) / 2, y: H - 8, class: "axis-label", "text-anchor": "middle" }, svg,
      (view ? "sample of step " + view.step + " (" : "sample (") +
      (n < all.length ? n + " shown, the largest of every " + thinning(all) + " of " : "") + all.length +
      (all.length === 1 ? " sample at " + span1.toFixed(2) + " s" : " samples over " +
        (view ? (span1 - span0).toFixed(3) + " s" : span1.toFixed(2) + " s")) +
      (view ? "); bands: the step's phases, in order" : "); bands: phase"));
    // the peak: the sample with the highest in-memory total, labelled with the report's peak when it is this one
    var best = 0;
    tl.forEach(function (s, k) { if (total(s.bytes, cats) > total(tl[best].bytes, cats)) best = k; });
    var s0 = tl[best], t0 = total(s0.bytes, cats), px = x(best), py = ys.y(t0);
    var label = t0 === rank.peak.total ? peakLabel(rank.peak) : peakLabel({ total: t0, step: s0.step, phase: s0.phase,
      unit: s0.unit }) + " (sampled; report peak " + fmt(rank.peak.total) + ")";
    var g = el("g", { class: "peak-marker" }, svg);
    el("line", { x1: px, x2: px, y1: py, y2: H - M.b, class: "peak-line" }, g);
    el("circle", { cx: px, cy: py, r: 5 }, g);
    el("text", { x: Math.min(Math.max(px, M.l + 150), W - M.r - 150), y: Math.max(py - 9, M.t + 10),
      "text-anchor": "middle", class: "peak-label" }, g, label);
    tip(g, label + "\n" + breakdown(s0.bytes, cats));
    // hover columns: one per sample, with its figures as title text
    var hover = el("g", { class: "hover" }, svg);
    tl.forEach(function (s, k) {
      tip(el("rect", { x: x(k) - half, y: M.t, width: 2 * half, height: H - M.t - M.b, class: "hover-col" }, hover),
        "t " + s.t.toFixed(3) + " s \u00b7 step " + s.step + " \u00b7 " + s.phase + (s.unit ? " \u00b7 " + s.unit : "") +
        " \u00b7 " + s.event + "\nin memory " + fmt(total(s.bytes, cats)) + "\n" + breakdown(s.bytes, cats) +
        "\nRSS " + fmt(s.rss) + (s.device_allocated ? "\ndevice allocated " + fmt(s.device_allocated) : ""));
    });
  }

  // (b, c) stacked bars: groups of bars, each bar = {label, bytes, estimate}; off-device tiers beside, unstacked
  function drawBars(parent, cats, groups, label) {
    var svg = newSvg(parent, label), stack = onDevice(cats), off = offDevice(cats);
    var bars = [];
    groups.forEach(function (g) { g.bars.forEach(function (b) { bars.push(b); }); });
    var max = Math.max.apply(null, bars.map(function (b) {
      return Math.max(total(b.bytes, cats), Math.max.apply(null, [0].concat(off.map(function (c) { return get(b.bytes, c); }))));
    }));
    var ys = yScale(max);
    axes(svg, ys, "peak memory");
    var slots = bars.length + groups.length, slot = (W - M.l - M.r) / Math.max(slots, 1);
    var bw = Math.min(slot * 0.8, 90), start = 0;  // a group: half a slot of gap, one slot per bar, half a slot
    groups.forEach(function (g) {
      g.bars.forEach(function (b, k) {
        var bx = M.l + (start + 1 + k) * slot - bw / 2, base = 0, sum = total(b.bytes, cats);
        stack.forEach(function (c) {
          var v = get(b.bytes, c);
          if (v <= 0) return;
          tip(el("rect", { x: bx, y: ys.y(base + v), width: bw, height: ys.y(base) - ys.y(base + v), fill: COLORS[c],
            class: "bar" + (b.estimate ? " estimate" : ""), "data-category": c }, svg),
            g.label + " \u00b7 " + b.label + "\n" + c + ": " + fmt(v) + " (" + (100 * v / Math.max(sum, 1)).toFixed(0) + "%)");
          base += v;
        });
        var ox = bx + bw + 2;
        off.forEach(function (c) {
          var v = get(b.bytes, c);
          if (v <= 0) return;
          tip(el("rect", { x: ox, y: ys.y(v), width: Math.max(bw / 6, 4), height: ys.y(0) - ys.y(v), fill: COLORS[c],
            class: "bar offdevice", "data-category": c }, svg), g.label + " \u00b7 " + b.label + "\n" + c + " (not on the device): " + fmt(v));
          ox += Math.max(bw / 6, 4) + 1;
        });
        el("text", { x: bx + bw / 2, y: ys.y(sum) - 4, class: "tick", "text-anchor": "middle" }, svg, fmt(sum));
        el("text", { x: bx + bw / 2, y: H - M.b + 14, class: "tick", "text-anchor": "middle" }, svg, b.label);
      });
      el("text", { x: M.l + (start + (g.bars.length + 1) / 2) * slot, y: H - M.b + 30, class: "group-label",
        "text-anchor": "middle" }, svg, g.label);
      start += g.bars.length + 1;
    });
  }

  function stepLabel(rank, view) {
    return "memory in step " + view.step + " of rank " + rank.rank + ", by phase";
  }

  // the zoomed step as a table: each phase's first sample (start) and largest (peak), by category
  function drawPhaseTable(parent, report, rank, view) {
    var cats = report.categories, table = el("table", { class: "phases" }, parent);
    var head = el("tr", {}, el("thead", {}, table));
    ["phase", "sample", "event", "unit"].concat(cats, ["in memory", ""]).forEach(function (c) {
      var th = el("th", {}, head, c);
      if (COLORS[c]) th.insertBefore(el("span", { class: "swatch", style: "background:" + COLORS[c] }), th.firstChild);
    });
    var body = el("tbody", {}, table);
    view.phases.forEach(function (run) {
      var start = run.samples[0], name = run.phase + (run.repeat > 1 ? " " + run.repeat : "");
      var rows = run.peak === start ? [["start, peak", start]] : [["start", start], ["peak", run.peak]];
      rows.forEach(function (at, k) {
        var s = rank.timeline[at[1]], peak = at[1] === view.peak && view.holds_peak;
        var tr = el("tr", { class: "phase-" + run.phase + (peak ? " peak-row" : ""), "data-phase": run.phase }, body);
        [k === 0 ? name : "", at[0], s.event, s.unit || ""].forEach(function (c) { el("th", {}, tr, c); });
        cats.forEach(function (c) { el("td", { class: OFF_DEVICE.indexOf(c) >= 0 ? "offdevice" : "" }, tr, fmt(get(s.bytes, c))); });
        el("td", { class: "total" }, tr, fmt(total(s.bytes, cats)));
        el("td", { class: "mark" }, tr, peak ? "\u2190 the rank's peak" : "");
      });
    });
  }

  function estimateBar(report) {
    return report.estimate ? [{ label: "estimate", bytes: report.estimate.bytes, estimate: true }] : [];
  }
  function maxRank(report) {
    return report.ranks.reduce(function (a, r) { return r.peak.total > a.peak.total ? r : a; });
  }

  // (b) the run's table: per rank, each category now, at the peak sample and at its own maximum over the run
  // (the maxima fall at different times: no total), the estimate; then the process figures
  function drawTables(parent, report) {
    var cats = report.categories, est = report.estimate, cuda = report.run.device === "cuda";
    var table = el("table", { class: "bytes" }, parent), thead = el("thead", {}, table), head = el("tr", {}, thead);
    var sub = el("tr", {}, thead);
    el("th", { rowspan: 2 }, head, "category");
    report.ranks.forEach(function (r) {
      el("th", { colspan: 3 }, head, "rank " + r.rank);
      el("th", {}, sub, "now");
      el("th", { title: "each category at the peak sample: they sum to the peak" }, sub, "at peak");
      el("th", { title: "each category's own maximum, reached at different times" }, sub, "max over run");
    });
    if (est) el("th", { rowspan: 2 }, head, "estimate (N=" + est.world_size + ")");
    var body = el("tbody", {}, table);
    function row(name, cells, e, cls) {
      var tr = el("tr", { class: cls || "" }, body);
      var th = el("th", {}, tr, name);
      if (COLORS[name]) th.insertBefore(el("span", { class: "swatch", style: "background:" + COLORS[name] }), th.firstChild);
      report.ranks.forEach(function (r) { cells(r).forEach(function (v) { el("td", {}, tr, v === null ? "" : fmt(v)); }); });
      if (est) el("td", {}, tr, e === null ? "" : fmt(e));
    }
    cats.forEach(function (c) {
      row(c, function (r) { return [get(r.current, c), get(r.peak.bytes, c), get(r.category_peak, c)]; },
        est ? get(est.bytes, c) : null, OFF_DEVICE.indexOf(c) >= 0 ? "offdevice" : "");
    });
    row("in memory", function (r) { return [total(r.current, cats), r.peak.total, null]; },
      est ? est.peak_total : null, "total");
    var proc = el("table", { class: "process" }, parent), ph = el("tr", {}, el("thead", {}, proc));
    var cols = ["rank", "accounted now", "peak (step, phase, unit)", "RSS", "peak RSS"];
    if (cuda) cols = cols.concat(["device allocated", "device peak", "reserved", "peak reserved"]);
    cols.push(cuda ? "unaccounted (allocated \u2212 accounted)" : "unaccounted (RSS \u2212 accounted)");
    cols.forEach(function (c) { el("th", {}, ph, c); });
    var pb = el("tbody", {}, proc);
    report.ranks.forEach(function (r) {
      var p = r.process, now = total(r.current, cats), tr = el("tr", {}, pb);
      var cells = [String(r.rank), fmt(now), peakLabel(r.peak).replace("peak ", ""), fmt(p.rss), fmt(p.peak_rss)];
      if (cuda) cells = cells.concat([fmt(p.device_allocated), fmt(p.device_peak), fmt(p.device_reserved), fmt(p.device_peak_reserved)]);
      cells.push(fmt((cuda ? p.device_allocated : p.rss) - now));
      cells.forEach(function (c) { el("td", {}, tr, c); });
    });
    if (est && est.notes.length) {
      var ul = el("ul", { class: "notes" }, parent);
      est.notes.forEach(function (n) { el("li", {}, ul, n); });
    }
  }

  function legend(parent, cats, reports) {
    var div = el("div", { class: "legend" }, parent);
    cats.forEach(function (c) {
      var item = el("span", { class: "legend-item" + (OFF_DEVICE.indexOf(c) >= 0 ? " offdevice" : "") }, div);
      el("span", { class: "swatch", style: "background:" + COLORS[c] }, item);
      item.appendChild(document.createTextNode(c + (OFF_DEVICE.indexOf(c) >= 0 ? " (other tier, not stacked)" : "")));
    });
    var cuda = reports.some(function (r) { return r.run.device === "cuda"; });
    var est = reports.some(function (r) { return r.estimate; });
    [["rss", "process RSS"]].concat(cuda ? [["device", "device allocated"]] : [], est ? [["estimate", "estimated peak"]] : [])
      .concat([["peak", "measured peak"]])
      .concat(PHASES.map(function (p) { return ["phase-" + p, p + " phase"]; }))
      .forEach(function (l) { var item = el("span", { class: "legend-item" }, div);
        el("span", { class: "key key-" + l[0] }, item); item.appendChild(document.createTextNode(l[1])); });
  }

  var drawn = 0, main = document.getElementById("report");
  function attempt(what, fn) {
    try { fn(); drawn++; } catch (err) {
      var msg = what + ": " + (err && err.stack ? err.stack : err);
      document.body.dataset.error = (document.body.dataset.error ? document.body.dataset.error + "\n" : "") + msg;
      el("pre", { class: "error" }, main, msg);
    }
  }
  var reports = JSON.parse(document.getElementById("report-data").textContent);
  var steps = JSON.parse(document.getElementById("step-data").textContent);  // per run, per rank: peak_step
  var allCats = Object.keys(COLORS).filter(function (c) {
    return reports.some(function (r) { return r.categories.indexOf(c) >= 0; });
  });
  legend(main, allCats, reports);
  if (reports.length > 1) {
    var cmp = el("section", { class: "comparison" }, main);
    el("h2", {}, cmp, "Comparison: each run's peak (the rank with the highest peak) beside its estimate");
    attempt("comparison", function () {
      drawBars(cmp, allCats, reports.map(function (rep) {
        var r = maxRank(rep);
        return { label: rep.run.name, bars: [{ label: "rank " + r.rank, bytes: r.peak.bytes, estimate: false }]
          .concat(estimateBar(rep)) };
      }), "peak memory of each run");
    });
  }
  reports.forEach(function (rep, ri) {
    var sec = el("section", { class: "run" }, main), run = rep.run;
    el("h2", {}, sec, run.name + (run.profile && run.profile !== run.name ? " (" + run.profile + ")" : ""));
    el("p", { class: "meta" }, sec, run.world_size + " rank(s) on " + run.device + (run.model ? " \u00b7 " + run.model : "") +
      (run.num_params ? " \u00b7 " + run.num_params.toLocaleString("en-US") + " parameters" : "") + " \u00b7 " + run.created);
    attempt(run.name + " bars", function () {
      drawBars(sec, rep.categories, rep.ranks.map(function (r) {
        return { label: "rank " + r.rank, bars: [{ label: "peak", bytes: r.peak.bytes, estimate: false }] };
      }).concat(rep.estimate ? [{ label: "estimate", bars: estimateBar(rep) }] : []), "peak memory per rank");
    });
    rep.ranks.forEach(function (r, k) {
      if (!r.timeline.length) return;
      var view = steps[ri][k];
      el("h3", {}, sec, "rank " + r.rank + ": memory over time");
      attempt(run.name + " rank " + r.rank + " timeline", function () { drawTimeline(sec, rep, r, null, view); });
      el("h3", {}, sec, "rank " + r.rank + ": step " + view.step + " zoomed in, by phase (" +
        (view.holds_peak ? "the step holding the peak" : "the step of the peak; its sample is not in the timeline") + ")");
      attempt(run.name + " rank " + r.rank + " step " + view.step, function () {
        drawTimeline(sec, rep, r, view, null);
        drawPhaseTable(sec, rep, r, view);
      });
    });
    if (rep.ranks.every(function (r) { return !r.timeline.length; })) {
      el("p", { class: "meta" }, sec, "No timeline: this report was taken without a memory tracker.");
    }
    drawTables(sec, rep);
  });
  document.body.dataset.rendered = String(drawn);
})();
