"use strict";
// SVG charts drawn in the browser, our own code (no library): a verdict strip over
// rollout id and per-step line charts. Every mark carries data-* attributes naming
// what it draws, so a test (or a curious user) can read the plotted data back.

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = {
    pass: "#2e9e44",
    diverged: "#d62728",
    refused: "#222222",
    unsupported: "#ff9f1c",
    unreplayed: "#b8bec6",
  };
  const SERIES = ["#1f77b4", "#2ca02c", "#9467bd", "#e377c2", "#8c564b", "#17becf"];

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value !== undefined && value !== null) node.setAttribute(key, String(value));
    }
    if (parent) parent.appendChild(node);
    return node;
  }

  function text(parent, x, y, content, attrs) {
    const node = el("text", Object.assign({ x, y }, attrs || {}), parent);
    node.textContent = content;
    return node;
  }

  function fmt(value) {
    if (value === null || value === undefined) return "null";
    if (Number.isInteger(value)) return String(value);
    if (value === 0) return "0";
    return Number(value).toPrecision(4).replace(/\.?0+(e|$)/, "$1");
  }

  // strip: the run's bins (GET /v1/runs/{run}/strip) as coloured rects over rollout id;
  // each bin's colour is its worst verdict; the first bad rollout gets a marker.
  function strip(data, { width = 900, height = 46, onPick } = {}) {
    const full = height + 34;
    const svg = el("svg", {
      class: "strip",
      width,
      height: full,
      viewBox: `0 0 ${width} ${full}`,
      role: "img",
      "aria-label": `verdicts of run ${data.run} by rollout id`,
      "data-rollout-from": data.rollout_from,
      "data-rollout-to": data.rollout_to,
    });
    if (!data.bins.length) {
      text(svg, 4, 20, "no steps in this range");
      return svg;
    }
    const lo = data.rollout_from;
    const span = data.rollout_to - lo + 1;
    const x = (rollout) => ((rollout - lo) / span) * width;
    el("rect", { x: 0, y: 12, width, height, fill: "#f3f5f7" }, svg);
    for (const bin of data.bins) {
      const x0 = x(bin.rollout_from);
      const rect = el(
        "rect",
        {
          class: "bin",
          x: x0.toFixed(2),
          y: 12,
          width: Math.max(x(bin.rollout_to + 1) - x0, 1).toFixed(2),
          height,
          fill: COLORS[bin.worst] || "#999",
          "data-worst": bin.worst,
          "data-rollout-from": bin.rollout_from,
          "data-rollout-to": bin.rollout_to,
          "data-steps": bin.steps,
        },
        svg,
      );
      const counts = Object.keys(COLORS)
        .filter((status) => bin[status])
        .map((status) => `${status} ${bin[status]}`)
        .join(", ");
      const range =
        bin.rollout_from === bin.rollout_to
          ? `rollout ${bin.rollout_from}`
          : `rollouts ${bin.rollout_from}-${bin.rollout_to}`;
      el("title", {}, rect).textContent = `${range}: ${bin.steps} step(s): ${counts}`;
      if (onPick) rect.addEventListener("click", () => onPick(bin));
    }
    if (data.first_bad_rollout !== null && data.first_bad_rollout !== undefined) {
      const bad = x(data.first_bad_rollout);
      const marker = el("g", { class: "first-bad", "data-rollout": data.first_bad_rollout }, svg);
      el("path", { d: `M${bad - 5},0 L${bad + 5},0 L${bad},10 Z`, fill: COLORS.diverged }, marker);
      el("line", { x1: bad, x2: bad, y1: 10, y2: 12 + height, stroke: COLORS.diverged }, marker);
      const anchor = bad > width - 160 ? "end" : "start";
      text(marker, bad + (anchor === "end" ? -8 : 8), 9, `first bad rollout ${data.first_bad_rollout}`, {
        "text-anchor": anchor,
      });
    }
    text(svg, 0, full - 4, `rollout ${data.rollout_from}`);
    text(svg, width, full - 4, `rollout ${data.rollout_to}`, { "text-anchor": "end" });
    return svg;
  }

  // lines: one chart of several series over the same x positions (step indices).
  // series: [{name, points: [{x, y, label}]}]; a null y is a gap, never drawn as 0.
  function lines(series, { width = 440, height = 230, metric = "", xLabels = [], onPick } = {}) {
    const margin = { left: 62, right: 12, top: 12, bottom: 44 };
    const plotWidth = width - margin.left - margin.right;
    const plotHeight = height - margin.top - margin.bottom;
    const svg = el("svg", {
      class: "lines",
      width,
      height,
      viewBox: `0 0 ${width} ${height}`,
      role: "img",
      "aria-label": metric,
      "data-metric": metric,
    });
    const values = series.flatMap((s) => s.points.map((p) => p.y)).filter((y) => y !== null);
    const count = Math.max(...series.map((s) => s.points.length), 1);
    let low = Math.min(0, ...values);
    let high = Math.max(...values, 0);
    if (high === low) high = low + 1;
    const px = (i) => margin.left + (count === 1 ? plotWidth / 2 : (i / (count - 1)) * plotWidth);
    const py = (y) => margin.top + (1 - (y - low) / (high - low)) * plotHeight;
    for (const tick of [low, (low + high) / 2, high]) {
      const y = py(tick);
      el("line", { class: "grid", x1: margin.left, x2: width - margin.right, y1: y, y2: y }, svg);
      text(svg, margin.left - 4, y + 4, fmt(tick), { "text-anchor": "end" });
    }
    el("line", { class: "axis", x1: margin.left, x2: margin.left, y1: margin.top, y2: margin.top + plotHeight }, svg);
    el("line", {
      class: "axis",
      x1: margin.left,
      x2: width - margin.right,
      y1: margin.top + plotHeight,
      y2: margin.top + plotHeight,
    }, svg);
    if (xLabels.length) {
      text(svg, px(0), margin.top + plotHeight + 14, `step ${xLabels[0]}`, { "text-anchor": "start" });
      if (xLabels.length > 1) {
        text(svg, px(xLabels.length - 1), margin.top + plotHeight + 14, `step ${xLabels[xLabels.length - 1]}`, {
          "text-anchor": "end",
        });
      }
    }
    series.forEach((s, index) => {
      const color = SERIES[index % SERIES.length];
      const group = el("g", { class: "series", "data-run": s.name, stroke: color, fill: color }, svg);
      let run = [];
      const flush = () => {
        if (run.length > 1) el("polyline", { points: run.join(" "), fill: "none", "stroke-width": 1.5, "pointer-events": "none" }, group);
        run = [];
      };
      for (const p of s.points) {
        if (p.y === null) {
          flush();
          continue;
        }
        const x = px(p.x);
        const y = py(p.y);
        run.push(`${x.toFixed(2)},${y.toFixed(2)}`);
        const dot = el("circle", {
          class: "pt",
          cx: x.toFixed(2),
          cy: y.toFixed(2),
          r: 2.5,
          "data-run": s.name,
          "data-step": p.label,
          "data-value": p.y,
        }, group);
        el("title", {}, dot).textContent = `${s.name} ${p.label}: ${fmt(p.y)}`;
        if (onPick) {
          dot.setAttribute("r", 3.5);
          dot.style.cursor = "pointer";
          dot.addEventListener("click", () => onPick(p));
        }
      }
      flush();
      const lx = margin.left + index * 110;
      el("rect", { x: lx, y: height - 14, width: 10, height: 10, stroke: "none" }, group);
      text(svg, lx + 14, height - 5, s.name);
    });
    return svg;
  }

  // heat: route mismatch rate per (step, layer) (GET /v1/runs/{run}/mismatch/layers):
  // one column per step (or per bin of steps: c.step is then its label), one row per
  // layer, darker = higher; a layer with nothing compared is left blank (never drawn as 0).
  function heat(items, { width = 900, rowHeight = 12, onPick } = {}) {
    const steps = [...new Set(items.map((c) => c.step))];
    const layers = Math.max(0, ...items.map((c) => c.layer + 1));
    const margin = { left: 62, top: 8, bottom: 30 };
    const height = margin.top + layers * rowHeight + margin.bottom;
    const svg = el("svg", {
      class: "heat",
      width,
      height,
      viewBox: `0 0 ${width} ${height}`,
      role: "img",
      "aria-label": "route mismatch rate per layer over steps",
    });
    if (!items.length) {
      text(svg, 4, 20, "no compared routes in this run");
      return svg;
    }
    const cell = (width - margin.left) / steps.length;
    const column = new Map(steps.map((step, i) => [step, i]));
    const top = Math.max(...items.map((c) => c.rate || 0), 1e-12);
    for (let layer = 0; layer < layers; layer += 1) {
      text(svg, margin.left - 4, margin.top + layer * rowHeight + rowHeight - 2, `layer ${layer}`, {
        "text-anchor": "end",
        "font-size": 9,
      });
    }
    for (const c of items) {
      if (c.rate === null) continue;
      const shade = Math.round(255 * (1 - c.rate / top));
      const rect = el("rect", {
        class: "cell",
        x: (margin.left + column.get(c.step) * cell).toFixed(2),
        y: margin.top + c.layer * rowHeight,
        width: Math.max(cell, 1).toFixed(2),
        height: rowHeight,
        fill: `rgb(255,${shade},${shade})`,
        "data-step": c.step,
        "data-layer": c.layer,
        "data-rate": c.rate,
        "data-steps": c.steps,
      }, svg);
      el("title", {}, rect).textContent = `${c.step} layer ${c.layer}: ${fmt(c.rate)} (${c.mismatches}/${c.observations})`;
      if (onPick) rect.addEventListener("click", () => onPick(c));
    }
    text(svg, margin.left, height - 8, `step ${steps[0].split("..")[0]}`);
    text(svg, width, height - 8, `step ${steps[steps.length - 1].split("..").pop()}`, { "text-anchor": "end" });
    return svg;
  }

  return { strip, lines, heat, fmt, COLORS };
})();
