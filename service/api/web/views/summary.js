// An ended (or checkpointed) job's summary as a small table: losses, wall clock and teleport's share of it, the
// target, and — when the job was started as one of a pair (`tlab demo` tags the teleport run `baseline:<id>`) —
// the verdict against its baseline, seconds first: the one that counts.

import { html, num, toTarget } from "../dom.js";

export const BASELINE_TAG = "baseline:";

export const baselineOf = (j) => (j.tags || []).find((t) => t.startsWith(BASELINE_TAG))?.slice(BASELINE_TAG.length);

const pct = (x) => (x === null || x === undefined ? "–" : `${Math.round(100 * x)} %`);
const ratio = (a, b) => `${num(Math.max(a, b) / Math.min(a, b), 3)}x`;

// "teleport reached the target in 1.4x fewer seconds and 2x fewer epochs (teleport took 9 % of its run)", or,
// when it loses on the clock, that first: "teleport lost on wall-clock: 2.2x more seconds to the target, ..."
export function verdict(t, b) {
  if (!t || !b || t.target_loss === null || t.target_loss === undefined) return null;
  const share = `teleport took ${pct(t.teleport_share)} of its run`;
  if (t.seconds_to_target == null && b.seconds_to_target == null) return `neither run reached the target (${share})`;
  if (t.seconds_to_target == null) return `teleport did not reach the target; the baseline did in ${b.epochs_to_target} epochs, ${num(b.seconds_to_target, 3)} s (${share})`;
  if (b.seconds_to_target == null) return `teleport reached the target in ${t.epochs_to_target} epochs, ${num(t.seconds_to_target, 3)} s; the baseline did not (${share})`;
  const epochs = `${ratio(t.epochs_to_target, b.epochs_to_target)} ${t.epochs_to_target <= b.epochs_to_target ? "fewer" : "more"} epochs`;
  if (t.seconds_to_target > b.seconds_to_target) {
    return `teleport lost on wall-clock: ${ratio(t.seconds_to_target, b.seconds_to_target)} more seconds to the target, though ${epochs} (${share})`;
  }
  return `teleport reached the target in ${ratio(t.seconds_to_target, b.seconds_to_target)} fewer seconds and ${epochs} (${share})`;
}

function rows(s) {
  const out = [["epochs", s.epochs], ["final train / test loss", `${num(s.final_train_loss)} / ${num(s.final_test_loss)}`]];
  if (s.final_test_acc !== undefined) out.push(["final / best test accuracy", `${num(s.final_test_acc)} / ${num(s.best_test_acc)}`]);
  if (s.final_test_ppl !== undefined) out.push(["final / best test perplexity", `${num(s.final_test_ppl)} / ${num(s.best_test_ppl)}`]);
  out.push(["wall clock", `${num(s.seconds, 3)} s`]);
  out.push(["teleport's share of it", `${pct(s.teleport_share)} (${num(s.teleport_seconds, 3)} s, ${s.teleport_batches ?? 0} batches)`]);
  if (s.teleport_budget !== undefined && s.teleport_budget !== null) {
    out.push(["teleport budget", `${pct(s.teleport_budget)}; ${s.teleport_cuts ?? 0} teleport epochs cut short`]);
  }
  if (s.teleport_skipped) out.push(["teleports stopped", s.teleport_skipped]);
  if (s.target_loss !== null && s.target_loss !== undefined) out.push(["to target loss", toTarget(s)]);
  return out;
}

// The table for summary `s`; `base` is the baseline job's view when the job has one (`baselineOf`).
export function summaryTable(s, base) {
  if (!s) return html`<p class="muted small">no summary yet: it is written at the first checkpoint</p>`;
  const all = rows(s);
  const said = base ? verdict(s, base.summary) : null;
  if (base) all.push(["baseline", html`<a href="#/job/${encodeURIComponent(base.id)}">${base.name || base.id}</a>`]);
  if (said) all.push(["verdict", said]);
  return html`<table class="summary"><tbody>${all.map(([k, v]) => html`<tr><th>${k}</th><td>${v}</td></tr>`)}</tbody></table>`;
}
