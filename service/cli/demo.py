"""``tlab demo`` (what ``make demo`` runs): the lab's main flow, end to end on this machine, as a measurement.

Starts the embedded stack (Redis, a Ray head, the API, the scheduler) and submits, through the REST API, the
paper's MNIST/SGD row on digits with and without teleport, for 5 seeds: a seed's baseline and its teleport run
(tagged ``baseline:<id>``, so its page compares the two) side by side, one CPU each of the stack's two, so whatever
else loads the machine loads both alike (one after the other, a busy minute fell on one run only: on a machine
shared with test runs the seconds ratio then moved by 2x between seeds). Each run is followed live over SSE (a
progress bar on a terminal, one plain line per epoch in a log or a pipe). Then it writes the overlaid loss
curves (``/plot.png``, against epochs and against seconds), prints a table of the runs and a verdict that puts
wall-clock seconds first, with the spread over the seeds, writes ``demo.json`` beside them, and stops the stack.
The verdict's seconds are each run's epochs to the target x the median training epoch of all the runs, + its own
teleport seconds (``steady_seconds``): the raw clock's ratio, said beside it, moved by up to 12 % between demos
on this machine, the steady one by under 1 %.

The setting is the paper's MNIST row (Table "Summary table for hyper-parameters": MLP [1024, 1024], SGD
η_prim = 2e-4, η_tele = 0.2, CAP = 5, n = 32, t = 8, τ = 1, teleport before epochs 0-4) with one change digits
needs: b = 4 teleport batches instead of 32 (digits has 1,438 training samples, MNIST 60,000), as the convergence
benchmark runs it, for the paper's 100 epochs. The target train loss is 1.7: the baseline reaches it near epoch 80,
teleport near epoch 35, so each run's seconds to the target add up over dozens of epochs (a target reached in the
first 15 epochs, as 2.0 is with teleport, left the ratio at the mercy of a few epochs' timing).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from api_schemas.presets import PRESETS
from service.cli.client import Client
from service.stack.embedded import Stack
from service.stack.supervise import Supervisor, supervise_policy

PRESET = "paper/mnist-sgd"
TARGET_LOSS = 1.7  # reached late enough in both runs to be timed over many epochs
BATCHES = 4  # teleport batches per scheduled epoch (the paper's 32 would teleport on 70 % of digits each time)
EPOCHS = 100  # the paper's
SEEDS = 5  # a seed's own seconds ratio moves by up to ~30 % between demos; the verdict pools them
SETTING = (f"the paper's MNIST/SGD row on digits: MLP [1024, 1024], SGD lr 2e-4, teleport lr 0.2, CAP 5, n 32, "
           f"t 8, tau 1, {BATCHES} teleport batches before epochs 0-4; target train loss {TARGET_LOSS}")


class StackDied(RuntimeError):
    """A part of the demo's stack kept dying (on a machine too busy for Ray's start-up, say)."""


class Supervised:
    """The demo's stack kept up as ``tlab up`` keeps its own: a part that dies is restarted (a Ray head that timed
    out starting on a busy machine, its jobs requeued to resume), a crash loop ends the demo."""

    def __init__(self, stack: Stack) -> None:
        self.stopping, self.verdict = threading.Event(), ""
        self.supervisor = Supervisor(stack, supervise_policy())
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self) -> None:
        self.verdict = self.supervisor.run(self.stopping) or ""

    def check(self) -> None:
        if not self.thread.is_alive() and self.verdict:
            raise StackDied(f"{self.verdict}; on a busy machine run `make demo` again")

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def follow(c: Client, watch: Supervised, jobs: dict[str, str], epochs: int) -> None:
    """Both runs of a seed at once, each on a thread of its own: a progress bar each on a terminal; in a log or a
    pipe (no cursor codes) one whole line per epoch and state, never two glued together."""
    tty = sys.stderr.isatty()
    lock = threading.Lock()
    threads = [threading.Thread(target=follow_one, args=(c, job_id, label, epochs, tty, i, lock, watch.stopping),
                                daemon=True)
               for i, (label, job_id) in enumerate(jobs.items())]
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(1.0)
        watch.check()


def follow_one(c: Client, job_id: str, label: str, epochs: int, tty: bool, position: int, lock: threading.Lock,
               stopping: threading.Event) -> None:
    try:
        follow_events(c, job_id, label, epochs, tty, position, lock)
    except Exception:
        if not stopping.is_set():  # the demo is ending (a crash loop): the closed client is no news
            raise


def follow_events(c: Client, job_id: str, label: str, epochs: int, tty: bool, position: int,
                  lock: threading.Lock) -> None:
    bar = None
    if tty:
        from tqdm import tqdm

        bar = tqdm(total=epochs, desc=f"{label:<22}", unit="epoch", position=position, leave=True)
    for event in c.events(job_id):
        d, line = event.data, None
        if event.kind == "metric":
            line = f"epoch {int(d['epoch']) + 1}/{epochs}  train {d['train_loss']:.4f}  test {d['test_loss']:.4f}"
            if bar is not None:
                bar.n = int(d["epoch"]) + 1
                bar.set_postfix_str(f"train {d['train_loss']:.4f} test {d['test_loss']:.4f}")
        elif event.kind == "status" and d.get("kind") in ("budget", "hint"):  # the run's records, as status
            line = d.get("message")
        elif event.kind == "status" and "at" in d:
            line = d["state"]
            if bar is not None:
                bar.set_postfix_str(d["state"])
        with lock:
            if bar is not None:
                bar.refresh()
            elif line:
                print(f"{label:<22} {line}", file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()


Pair = tuple[dict[str, Any], dict[str, Any]]  # (with teleport, without) summaries of one seed


def _times(ratio: float) -> str:
    """0.4 -> "2.50x fewer", 1.25 -> "1.25x more"."""
    return f"{1 / ratio:.2f}x fewer" if ratio <= 1 else f"{ratio:.2f}x more"


STEADY = "steady_seconds_to_target"  # a run's seconds to the target as the verdict counts them (``steady_seconds``)


def training_seconds(points: list[dict[str, Any]]) -> list[float]:
    """Each epoch's training seconds: the run's clock since the epoch before, less the teleport seconds within it."""
    out, last_s, last_t = [], 0.0, 0.0
    for p in points:
        s, t = float(p["seconds"]), float(p.get("teleport_seconds") or 0.0)
        out.append((s - last_s) - (t - last_t))
        last_s, last_t = s, t
    return out


def steady_seconds(runs: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> float | None:
    """Give each run's summary (of ``(summary, epoch points)``) that reached the target its ``STEADY`` seconds: its
    epochs to the target x the median training epoch of all the runs up to their targets, + its own teleport seconds
    to the target as measured. The same network on the same data costs the same per epoch with or without teleport;
    what moves it is the machine (the two runs of a seed, side by side, saw their epochs differ by up to 7 %, and a
    busy minute stretches a few), which the median leaves out. Returns that median (None: no run reached it)."""
    reached = [(s, pts) for s, pts in runs if s.get("epochs_to_target") and len(pts) >= s["epochs_to_target"]]
    pooled = [x for s, pts in reached for x in training_seconds(pts)[: s["epochs_to_target"]]]
    if not pooled:
        return None
    epoch = statistics.median(pooled)
    for s, pts in reached:
        n = s["epochs_to_target"]
        s[STEADY] = n * epoch + float(pts[n - 1].get("teleport_seconds") or 0.0)
    return epoch


def _key(pairs: list[Pair]) -> str:
    """``STEADY`` when every run has it, else the raw clock's ``seconds_to_target``."""
    return STEADY if all(STEADY in s for pair in pairs for s in pair) else "seconds_to_target"


def _ratio(pairs: list[Pair], key: str) -> tuple[float, float, float]:
    """Teleport's value over the baseline's: pooled over the seeds (sum over sum), and the per-seed min and max."""
    per_seed = [t[key] / b[key] for t, b in pairs]
    return sum(t[key] for t, _ in pairs) / sum(b[key] for _, b in pairs), min(per_seed), max(per_seed)


def seconds_ratio(pairs: list[Pair], key: str = "") -> float | None:
    """Teleport's seconds to the target over the baseline's, pooled over the seeds (``STEADY`` where there, else the
    raw clock; ``key`` picks one); None when a run missed it."""
    key = key or _key(pairs)
    if any(s.get(key) is None for pair in pairs for s in pair):
        return None
    return _ratio(pairs, key)[0]


def verdict(pairs: list[Pair], epoch_s: float | None = None) -> str:
    """Seconds first (the one that counts), then epochs, each pooled over the seeds with the per-seed range; a loss
    on the clock is said first, and a range that straddles 1 is said to decide nothing. With ``epoch_s`` (the median
    epoch of ``steady_seconds``) the seconds are the steady ones, and the raw clock's ratio is said beside them."""
    n = len(pairs)
    share = statistics.mean(t.get("teleport_share") or 0 for t, _ in pairs)
    share_text = f"teleport took {100 * share:.0f} % of its runs"
    reached_t = sum(t.get("seconds_to_target") is not None for t, _ in pairs)
    reached_b = sum(b.get("seconds_to_target") is not None for _, b in pairs)
    if reached_t < n or reached_b < n:
        loss_t, loss_b = (statistics.mean(s.get("final_train_loss") or float("nan") for s in arm)
                          for arm in zip(*pairs, strict=True))
        return (f"no verdict: teleport reached the target in {reached_t} of {n} seeds, the baseline in {reached_b}; "
                f"final train loss {loss_t:.4f} with teleport vs {loss_b:.4f} ({share_text})")
    key = _key(pairs) if epoch_s is not None else "seconds_to_target"
    s, s_lo, s_hi = _ratio(pairs, key)
    e, e_lo, e_hi = _ratio(pairs, "epochs_to_target")
    over = f"over {n} seeds" if n > 1 else "one seed"
    seconds = f"{_times(s)} seconds to the target ({over}: {s_lo:.2f}-{s_hi:.2f}x the baseline's)"
    epochs = f"{_times(e)} epochs ({e_lo:.2f}-{e_hi:.2f}x)"
    if key == STEADY:
        c, c_lo, c_hi = _ratio(pairs, "seconds_to_target")
        share_text += (f"; seconds counted as epochs x the median epoch, {epoch_s:.3f} s, + teleport's own seconds; "
                       f"the raw clock said {c:.2f}x, {c_lo:.2f}-{c_hi:.2f}x")
    if s_lo < 1 < s_hi:
        return f"no verdict on wall-clock: {seconds}, {epochs}; the seeds disagree ({share_text})"
    if s > 1:
        return f"teleport lost on wall-clock: {seconds}, though {epochs} ({share_text})"
    return f"teleport won on wall-clock: {seconds} and {epochs} ({share_text})"


def row(label: str, job: dict[str, Any]) -> str:
    s = job.get("summary") or {}

    def f(key: str, fmt: str = ".4f") -> str:
        v = s.get(key)
        return "-" if v is None else format(v, fmt)

    return (f"{label:<22} {job['state']:<10} {f('epochs_to_target', 'd'):>8} {f('seconds_to_target', '.1f'):>9} "
            f"{f('final_train_loss'):>11} {f('final_test_acc'):>9} {f('teleport_share', '.3f'):>9} "
            f"{f('seconds', '.1f'):>7}")


def specs(epochs: int, seed: int) -> dict[str, dict[str, Any]]:
    """The baseline first (the teleport run names it in a tag), then the same with teleport."""
    out = {}
    for on in (False, True):
        spec = {k: dict(v) for k, v in PRESETS[PRESET].items()}
        spec["dataset"] = {"name": "digits"}
        spec["training"].update(epochs=epochs, target_loss=TARGET_LOSS, seed=seed)
        spec["teleport"].update(enabled=on, batches=BATCHES)
        out[f"{'with' if on else 'without'} teleport s{seed}"] = spec
    return out


def write_figures(path: Path, epochs: int, pairs: list[Pair], views: dict[str, dict[str, Any]],
                  load_before: str, epoch_s: float | None) -> None:
    """The demo's figures as JSON: the setting, the ratios (steady and raw clock), the verdict, the load, each run's
    summary."""
    runs = {label: {"id": v["id"], "state": v["state"],
                    "summary": {k: x for k, x in (v.get("summary") or {}).items() if k != "spec"}}
            for label, v in views.items()}
    path.write_text(json.dumps({
        "setting": SETTING, "epochs": epochs, "seeds": len(pairs), "seconds_ratio": seconds_ratio(pairs),
        "wall_clock_ratio": seconds_ratio(pairs, "seconds_to_target"), "median_epoch_seconds": epoch_s,
        "verdict": verdict(pairs, epoch_s), "loadavg_before": load_before, "loadavg_after": load(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs}, indent=1, default=str))


def stack_env(seeds: int) -> dict[str, str]:
    """The demo's stack settings: every run of the demo (two a seed) in its one plot."""
    return {"TLAB_MAX_COMPARE": str(max(8, 2 * seeds))}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(home: Path, epochs: int = EPOCHS, seeds: int = SEEDS) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a kill stops the demo's stack, as Ctrl-C does
    try:
        return run(home, epochs, seeds)
    except StackDied as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def run(home: Path, epochs: int, seeds: int) -> int:
    print(f"{SETTING}; {epochs} epochs, {seeds} seed(s), a seed's two runs side by side", flush=True)
    print(f"starting the embedded stack in {home} (Redis, Ray head, API, scheduler) ...", flush=True)
    t0, load_before = time.monotonic(), load()
    with Stack(home.resolve(), num_cpus=2, extra_env=stack_env(seeds)) as stack, \
            Client(stack.url, stack.admin_token) as c:
        print(f"up in {time.monotonic() - t0:.0f} s at {stack.url}; submitting through the API", flush=True)
        watch = Supervised(stack)
        jobs: dict[str, str] = {}
        try:
            for seed in range(seeds):  # a seed's two runs side by side, a core each: what loads the machine loads both
                pair: dict[str, str] = {}
                for label, spec in specs(epochs, seed).items():
                    tags = ["demo"] + [f"baseline:{j}" for j in pair.values()]
                    pair[label] = c.submit(spec, name=f"digits {label}", tags=tags)["id"]
                follow(c, watch, pair, epochs)
                jobs.update(pair)
        finally:
            watch.stop()  # before the client closes: a follower thread still reading then ends quietly
        views = {label: c.get(job) for label, job in jobs.items()}
        points = {label: c.json("GET", f"/v1/experiments/{job}/metrics")["points"] for label, job in jobs.items()}
        out = home / "curves.png"
        out.write_bytes(c.plot(list(jobs.values())))
    print(f"\n{SETTING}; {epochs} epochs; load average (1/5/15 min) {load_before} before, {load()} after")
    print(f"{'':<22} {'state':<10} {'epochs→':>8} {'seconds→':>9} {'train loss':>11} {'test acc':>9} "
          f"{'teleport':>9} {'wall s':>7}")
    for label in views:
        print(row(label, views[label]))
    pairs = [((views[f"with teleport s{i}"].get("summary") or {}), (views[f"without teleport s{i}"].get("summary")
                                                                   or {})) for i in range(seeds)]
    epoch_s = steady_seconds([(s, points[label]) for label, v in views.items() for s in [v.get("summary") or {}]])
    print(verdict(pairs, epoch_s))
    ratio, clock = seconds_ratio(pairs), seconds_ratio(pairs, "seconds_to_target")
    if ratio is not None and clock is not None:
        print(f"seconds ratio, teleport / baseline, pooled over the seeds: {ratio:.3f} (the raw clock's: {clock:.3f})")
    write_figures(home / "demo.json", epochs, pairs, views, load_before, epoch_s)
    print(f"curves: {out} (against epochs and against seconds, teleport time shaded); figures: {home / 'demo.json'}")
    return 0 if all(v["state"] == "succeeded" for v in views.values()) else 1
