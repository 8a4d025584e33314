// Line charts on the vendored uPlot (a global from static/vendor/uPlot.iife.min.js).

/* global uPlot */

export const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
export const TRAIN = "#1f77b4"; // blue
export const TEST = "#ff7f0e"; // orange
const WHOLE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
const MARK = "rgba(148, 103, 189, 0.45)"; // teleport epochs: faint purple verticals

// A chart that fills its container's width. `marks()` returns x values drawn as vertical lines.
export function lineChart(el, { series, yLabel, xLabel = "epoch", height = 260, log = false, marks = null }) {
  const opts = {
    width: Math.max(240, el.clientWidth),
    height,
    scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
    // x is a count (epochs, teleports): whole-number ticks only
    axes: [{ label: xLabel, incrs: WHOLE }, { label: yLabel, size: 64 }],
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
  return u;
}

function drawMarks(u, xs) {
  const { ctx, bbox } = u;
  ctx.save();
  ctx.strokeStyle = MARK;
  ctx.lineWidth = 1;
  for (const x of xs) {
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
