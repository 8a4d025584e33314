"""``tlab demo`` (what ``make demo`` runs): the lab's main flow, end to end on this machine.

Starts the embedded stack (Redis, a Ray head, the API, the scheduler), submits digits without teleport
through the REST API and follows it live over SSE (a progress bar on a terminal, a plain line per epoch in a
log or a pipe), then the same with teleport (tagged ``baseline:<id>``, so its page compares the two): one
after the other, so each run is timed on an otherwise idle stack, not sharing the cores with the other. Writes
the overlaid loss curves from ``/plot.png`` (against epochs and against seconds), prints the comparison and a
verdict that puts wall-clock seconds first, and stops the stack.

The settings are the ones the convergence benchmark backs on digits: the paper's rates, b = 4 teleport
batches before each of the first 5 epochs (32 would teleport on 70 % of digits' training set each time),
and ``teleport.budget`` at its default of 10 % of the run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from api_schemas.presets import PRESETS
from service.cli.client import Client
from service.stack.embedded import Stack

TARGET_LOSS = 0.05
BATCHES = 4  # teleport batches per scheduled epoch: the convergence benchmark's digits setting
# Under this many seconds to the target the seconds ratio is noise-bound: five demos of seed 0, one run after the
# other, gave 1.00-1.14x more seconds for 13 vs 16 epochs every time (docs/results.md)
SHORT_RUN_S = 5.0


def follow(c: Client, job_id: str, label: str, epochs: int) -> None:
    """A progress bar on a terminal; in a log or a pipe (no cursor codes) one plain line per epoch and state."""
    if not sys.stderr.isatty():
        return follow_plain(c, job_id, label, epochs)
    from tqdm import tqdm

    with tqdm(total=epochs, desc=f"{label:<17}", unit="epoch", leave=True) as bar:
        for event in c.events(job_id):
            if event.kind == "metric":
                bar.n = int(event.data["epoch"]) + 1
                bar.set_postfix_str(f"train {event.data['train_loss']:.4f} test {event.data['test_loss']:.4f}")
                bar.refresh()
            elif event.kind == "status" and "at" in event.data:
                bar.set_postfix_str(event.data["state"])


def follow_plain(c: Client, job_id: str, label: str, epochs: int) -> None:
    for event in c.events(job_id):
        line = None
        if event.kind == "metric":
            d = event.data
            line = f"epoch {int(d['epoch']) + 1}/{epochs}  train {d['train_loss']:.4f}  test {d['test_loss']:.4f}"
        elif event.kind == "status" and event.data.get("kind") in ("budget", "hint"):  # the run's records, as status
            line = event.data.get("message")
        elif event.kind == "status" and "at" in event.data:
            line = event.data["state"]
        if line:
            print(f"{label:<17} {line}", file=sys.stderr, flush=True)


def _times(a: float, b: float) -> str:
    return f"{max(a, b) / min(a, b):.2f}x"


def verdict(tele: dict[str, Any], base: dict[str, Any]) -> str:
    """Both ratios, seconds first (the one that counts), and teleport's share of its run; a loss on the
    clock is said first: "teleport lost on wall-clock: 2.20x more seconds to the target, though 2.00x fewer
    epochs (teleport took 59 % of its run)"."""
    share = f"teleport took {100 * (tele.get('teleport_share') or 0):.0f} % of its run"
    st, sb = tele.get("seconds_to_target"), base.get("seconds_to_target")
    et, eb = tele.get("epochs_to_target"), base.get("epochs_to_target")
    if st is None or sb is None or not et or not eb:
        if st is None and sb is None:
            loss_t, loss_b = (s.get("final_train_loss") or float("nan") for s in (tele, base))
            return (f"neither run reached the target; after {tele.get('epochs')} epochs train loss {loss_t:.4f} with "
                    f"teleport vs {loss_b:.4f}, in {tele.get('seconds') or 0:.1f} vs {base.get('seconds') or 0:.1f} "
                    f"seconds ({share})")
        if st is None:
            return f"teleport did not reach the target; without teleport: {eb} epochs, {sb:.1f} s ({share})"
        return f"teleport reached the target in {et} epochs, {st:.1f} s; without teleport it did not ({share})"
    epochs = f"{_times(et, eb)} {'fewer' if et <= eb else 'more'} epochs"
    if st > sb:
        return f"teleport lost on wall-clock: {_times(st, sb)} more seconds to the target, though {epochs} ({share})"
    return f"teleport reached the target in {_times(st, sb)} fewer seconds and {epochs} ({share})"


def noise_note(tele: dict[str, Any], base: dict[str, Any]) -> str | None:
    """When both runs reached the target in seconds too few to time on a shared machine: say which ratio holds."""
    seconds = [s.get("seconds_to_target") for s in (tele, base)]
    if None in seconds or max(seconds) >= SHORT_RUN_S:
        return None
    return (f"(both runs reached the target in under {SHORT_RUN_S:.0f} s: between demos on a 2-core machine the "
            "seconds ratio moved by up to 14 %, the epochs not at all; docs/results.md has where teleport's lead "
            "grows)")


def row(label: str, job: dict[str, Any]) -> str:
    s = job.get("summary") or {}

    def f(key: str, fmt: str = ".4f") -> str:
        v = s.get(key)
        return "-" if v is None else format(v, fmt)

    return (f"{label:<17} {job['state']:<10} {f('epochs_to_target', 'd'):>8} {f('seconds_to_target', '.1f'):>9} "
            f"{f('final_train_loss'):>11} {f('final_test_loss'):>10} {f('final_test_acc'):>9} {f('seconds', '.1f'):>7}")


def main(home: Path, epochs: int = 20) -> int:
    base = PRESETS["digits/teleport"]
    specs = {}
    for on in (False, True):  # the baseline first: the teleport run names it in a tag
        spec = {k: dict(v) for k, v in base.items()}
        spec["training"].update(epochs=epochs, target_loss=TARGET_LOSS)
        spec["teleport"].update(enabled=on, batches=BATCHES)
        specs["with teleport" if on else "without teleport"] = spec
    print(f"starting the embedded stack in {home} (Redis, Ray head, API, scheduler) ...", flush=True)
    t0 = time.monotonic()
    with Stack(home.resolve(), num_cpus=2) as stack, Client(stack.url, stack.admin_token) as c:
        print(f"up in {time.monotonic() - t0:.0f} s at {stack.url}; submitting through the API", flush=True)
        jobs: dict[str, str] = {}
        for label, spec in specs.items():  # one after the other: each timed on an idle stack
            tags = ["demo"] + [f"baseline:{j}" for j in jobs.values()]
            jobs[label] = c.submit(spec, name=f"digits {label}", tags=tags)["id"]
            follow(c, jobs[label], label, epochs)
        views = {label: c.get(job) for label, job in jobs.items()}
        out = home / "curves.png"
        out.write_bytes(c.plot(list(jobs.values())))
    print(f"\nMLP [256, 256] on digits, SGD lr 0.05, {epochs} epochs, teleport {BATCHES} batches before epochs 0-4 "
          f"(budget 10 % of the run); target train loss {TARGET_LOSS}")
    print(f"{'':<17} {'state':<10} {'epochs→':>8} {'seconds→':>9} {'train loss':>11} {'test loss':>10} "
          f"{'test acc':>9} {'wall s':>7}")
    for label in ("with teleport", "without teleport"):
        print(row(label, views[label]))
    summaries = [views[label].get("summary") or {} for label in ("with teleport", "without teleport")]
    print(verdict(*summaries))
    if note := noise_note(*summaries):
        print(note)
    print(f"curves: {out} (against epochs and against seconds, teleport time shaded)")
    return 0 if all(v["state"] == "succeeded" for v in views.values()) else 1
