// Line charts on the vendored uPlot (a global from static/vendor/uPlot.iife.min.js).

/* global uPlot */

export const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
export const TRAIN = "#1f77b4"; // blue
export const TEST = "#ff7f0e"; // orange
const WHOLE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
const MARK = "rgba(148, 103, 189, 0.45)"; // teleport epochs: faint purple verticals

// A chart that fills its container's width. `marks()` returns x values (or {x, color}) drawn as vertical lines;
// `whole` keeps x ticks on whole numbers (counts: epochs, teleports), off for seconds; `origin` starts x at 0.
export function lineChart(el, { series, yLabel, xLabel = "epoch", height = 260, log = false, marks = null, whole = true,
  origin = false }) {
  const x = { time: false, ...(origin ? { range: (_u, _lo, hi) => [0, hi > 0 ? hi : 1] } : {}) };
  const opts = {
    width: Math.max(240, el.clientWidth),
    height,
    scales: { x, y: log ? { distr: 3 } : {} },
    axes: [whole ? { label: xLabel, incrs: WHOLE } : { label: xLabel }, { label: yLabel, size: 64 }],
    legend: { live: true },
    series: [
      { label: xLabel },
      ...series.map((s) => ({
        label: s.label, stroke: s.color, width: s.width ?? 2, dash: s.dash, spanGaps: true,
        points: { size: 5 },
      })),
    ],
    hooks: marks ? { draw: [(u) => drawMarks(u, marks())] } : {},
  };
  const u = new uPlot(opts, [[], ...series.map(() => [])], el);
  const ro = new ResizeObserver(() => {
    const w = Math.max(240, el.clientWidth);
    if (w !== u.width) u.setSize({ width: w, height });
  });
  ro.observe(el);
  u.tlabStop = () => ro.disconnect();
  u.tlabMarks = marks; // what the marks are, for the page's tests
  return u;
}

function drawMarks(u, xs) {
  const { ctx, bbox } = u;
  ctx.save();
  ctx.lineWidth = 1;
  for (const m of xs) {
    const x = typeof m === "number" ? m : m.x;
    ctx.strokeStyle = typeof m === "number" ? MARK : m.color;
    ctx.setLineDash(typeof m === "number" ? [] : [4, 3]); // a run's own marks: dashed, in its colour
    const px = u.valToPos(x, "x", true);
    if (px < bbox.left || px > bbox.left + bbox.width) continue;
    ctx.beginPath();
    ctx.moveTo(px, bbox.top);
    ctx.lineTo(px, bbox.top + bbox.height);
    ctx.stroke();
  }
  ctx.restore();
}

export function destroy(u) {
  if (!u) return;
  u.tlabStop?.();
  u.destroy();
}

// Several series given as Map(x -> y) each, on one shared, sorted x axis (gaps are null).
export function aligned(maps) {
  const xs = [...new Set(maps.flatMap((m) => [...m.keys()]))].sort((a, b) => a - b);
  return [xs, ...maps.map((m) => xs.map((x) => (m.has(x) ? m.get(x) : null)))];
}

// Calls fn at most every `ms` (live streams send history in bursts: redraw once per burst).
export function throttle(fn, ms = 150) {
  let timer = null;
  return () => {
    if (timer === null) timer = setTimeout(() => { timer = null; fn(); }, ms);
  };
}
