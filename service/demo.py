"""``tlab demo`` (what ``make demo`` runs): the lab's main flow, end to end on this machine.

Starts the embedded stack (Redis, a Ray head, the API, the scheduler), submits digits with and
without teleport through the REST API, follows both live over SSE (a progress bar each), writes the
overlaid loss curves from ``/plot.png``, prints the comparison, and stops the stack.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from api_schemas.presets import PRESETS
from service.client import Client
from service.stack import Stack

TARGET_LOSS = 0.05


def follow(c: Client, job_id: str, label: str, position: int, epochs: int, done: dict[str, str]) -> None:
    from tqdm import tqdm

    with tqdm(total=epochs, desc=f"{label:<17}", unit="epoch", position=position, leave=True) as bar:
        for event in c.events(job_id):
            if event.kind == "metric":
                bar.n = int(event.data["epoch"]) + 1
                bar.set_postfix_str(f"train {event.data['train_loss']:.4f} test {event.data['test_loss']:.4f}")
                bar.refresh()
            elif event.kind == "status" and "at" in event.data:
                bar.set_description_str(f"{label:<17}")
                bar.set_postfix_str(event.data["state"])
            elif event.kind == "end":
                done[job_id] = event.data["state"]


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
    for on in (True, False):
        spec = {k: dict(v) for k, v in base.items()}
        spec["training"].update(epochs=epochs, target_loss=TARGET_LOSS)
        spec["teleport"]["enabled"] = on
        specs["with teleport" if on else "without teleport"] = spec
    print(f"starting the embedded stack in {home} (Redis, Ray head, API, scheduler) ...", flush=True)
    t0 = time.monotonic()
    with Stack(home.resolve(), num_cpus=2) as stack, Client(stack.url, stack.admin_token) as c:
        print(f"up in {time.monotonic() - t0:.0f} s at {stack.url}; submitting through the API", flush=True)
        jobs = {label: c.submit(spec, name=f"digits {label}", tags=["demo"])["id"] for label, spec in specs.items()}
        done: dict[str, str] = {}
        threads = [threading.Thread(target=follow, args=(c, job, label, i, epochs, done), daemon=True)
                   for i, (label, job) in enumerate(jobs.items())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        views = {label: c.get(job) for label, job in jobs.items()}
        out = home / "curves.png"
        out.write_bytes(c.plot(list(jobs.values())))
    print(f"\nMLP [256, 256] on digits, SGD lr 0.05, {epochs} epochs; target train loss {TARGET_LOSS}")
    print(f"{'':<17} {'state':<10} {'epochs→':>8} {'seconds→':>9} {'train loss':>11} {'test loss':>10} "
          f"{'test acc':>9} {'wall s':>7}")
    for label, view in views.items():
        print(row(label, view))
    a, b = (views[k].get("summary") or {} for k in specs)
    if a.get("epochs_to_target") and b.get("epochs_to_target"):
        print(f"teleport reached the target in {b['epochs_to_target'] / a['epochs_to_target']:.2f}x fewer epochs")
    print(f"curves: {out}")
    return 0 if all(v["state"] == "succeeded" for v in views.values()) else 1
