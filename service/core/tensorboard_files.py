"""A job's TensorBoard event files, written on the trusted side from its deduplicated per-epoch records.

Where: ``$TLAB_HOME/tensorboard/<job>/`` (a sweep: one run directory per trial under it), outside the job's own
storage directory, which its code can write (a link planted there must not steer a trusted write). What: one
scalar event per epoch at ``step = epoch`` (losses, accuracy, learning rate, gradient norm, seconds, and per epoch
the teleports' ‖∇L‖² and loss before/after, their steps ("moves") and teleport's share of the time so far); a sweep's
trials also carry the HParams plugin's session (their config) and the sweep root its experiment (the searched paths
and the metrics), so TensorBoard's HParams tab compares them.

Every epoch once: records are kept by (trial, epoch), the first one written wins (the stream already holds each
epoch once across a kill -9 and a resume; this holds even if a job wrote one twice). The file is rewritten whole,
with fixed wall times and a fixed name, so each rewrite starts with the bytes of the one before: TensorBoard,
which reads a file on from where it stopped, sees only the new epochs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from service.core.settings import Settings

FILE = "events.out.tfevents.0.tlab"  # "events.out.tfevents" in the name is what TensorBoard looks for
SKIP = frozenset({"kind", "epoch", "time", "trial", "job", "rank"})
NAMES = {"train_loss": "loss/train", "test_loss": "loss/test", "test_acc": "accuracy/test",
         "test_ppl": "perplexity/test", "lr": "train/lr", "grad_norm": "train/grad_norm"}
TELEPORT_MEANS = ("grad_norm_sq_before", "grad_norm_sq_after", "loss_before", "loss_after", "heldout_loss_before",
                  "heldout_loss_after")
Records = list[dict[str, Any]]


def directory(settings: Settings, job_id: str) -> Path:
    return Path(settings.home) / "tensorboard" / job_id


def number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def by_trial(records: Records) -> dict[str, tuple[Records, Records]]:
    """``trial`` ('' for an experiment) -> (its epoch records, one per epoch, in epoch order; its teleports)."""
    epochs: dict[str, dict[int, dict[str, Any]]] = {}
    teleports: dict[str, Records] = {}
    for r in records:
        trial, epoch = str(r.get("trial") or ""), r.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            continue
        if r.get("kind") == "epoch":
            epochs.setdefault(trial, {}).setdefault(epoch, r)
        elif r.get("kind") == "teleport":
            teleports.setdefault(trial, []).append(r)
    return {t: ([rows[e] for e in sorted(rows)], teleports.get(t, [])) for t, rows in epochs.items()}


def scalars(epoch: dict[str, Any], teleports: Records) -> dict[str, float]:
    """One epoch's values by TensorBoard tag."""
    out = {NAMES.get(k, f"epoch/{k}"): float(v) for k, v in epoch.items() if k not in SKIP and number(v)}
    if number(epoch.get("teleport_seconds")) and number(epoch.get("seconds")) and epoch["seconds"] > 0:
        out["teleport/share"] = epoch["teleport_seconds"] / epoch["seconds"]
    mine = [t for t in teleports if t.get("epoch") == epoch["epoch"]]
    if mine:
        out["teleport/moves"] = float(sum(t["steps"] for t in mine if number(t.get("steps"))))
        for key in TELEPORT_MEANS:
            values = [t[key] for t in mine if number(t.get(key))]
            if values:
                out[f"teleport/{key}"] = sum(values) / len(values)
    return out


def scalar_events(epochs: Records, teleports: Records, start: float) -> list[Event]:
    """The file-version header, then one event per epoch (wall time: the job's start + the epoch's seconds)."""
    out = [Event(wall_time=start, file_version="brain.Event:2")]
    for e in epochs:
        wall = start + (float(e["seconds"]) if number(e.get("seconds")) else float(e["epoch"]))
        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in sorted(scalars(e, teleports).items())]
        out.append(Event(wall_time=wall, step=int(e["epoch"]), summary=Summary(value=values)))
    return out


def _hparam_value(v: Any) -> Any:
    from google.protobuf import struct_pb2

    if isinstance(v, bool):
        return struct_pb2.Value(bool_value=v)
    if number(v):
        return struct_pb2.Value(number_value=float(v))
    return struct_pb2.Value(string_value=str(v))


def _plugin_event(tag: str, data: plugin_data_pb2.HParamsPluginData, wall: float) -> Event:
    value = Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))
    return Event(wall_time=wall, summary=Summary(value=[value]))


def session_events(config: dict[str, Any], ended: str | None, start: float) -> tuple[list[Event], list[Event]]:
    """A trial's HParams session: its config (first) and, once the sweep has ended, its end (last)."""
    start_info = plugin_data_pb2.SessionStartInfo(start_time_secs=start)
    for k, v in sorted(config.items()):
        start_info.hparams[k].CopyFrom(_hparam_value(v))
    first = [_plugin_event(metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(
        session_start_info=start_info, version=metadata.PLUGIN_DATA_VERSION), start)]
    out: list[Event] = []
    if ended:
        status = api_pb2.STATUS_SUCCESS if ended in ("succeeded", "stopped early") else api_pb2.STATUS_FAILURE
        end = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=start)
        out.append(_plugin_event(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(
            session_end_info=end, version=metadata.PLUGIN_DATA_VERSION), start))
    return first, out


def experiment_event(paths: Iterable[str], tags: Iterable[str], start: float) -> Event:
    """The sweep's HParams experiment: the searched spec paths and the metrics (tags) to compare them on."""
    exp = api_pb2.Experiment(hparam_infos=[api_pb2.HParamInfo(name=p) for p in sorted(paths)],
                             metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in sorted(tags)],
                             time_created_secs=start)
    return _plugin_event(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(
        experiment=exp, version=metadata.PLUGIN_DATA_VERSION), start)


def write_file(folder: Path, events: list[Event]) -> None:
    """``folder/FILE`` holding ``events``, replaced atomically (a reader never sees half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{FILE}.tmp"
    with tmp.open("wb") as f:
        writer = RecordWriter(f)
        for e in events:
            writer.write(e.SerializeToString())
    os.replace(tmp, folder / FILE)


def write_job(folder: Path, records: Records, start: float, trials: dict[str, dict[str, Any]] | None = None,
              ended: str | None = None) -> int:
    """Write an experiment's file (``trials`` None) or a sweep's (one run directory per trial, ``trials``: trial id
    -> {"config", "state"}, plus the HParams experiment at its root); the number of epochs written."""
    runs = by_trial(records)
    if trials is None:
        epochs, teleports = runs.get("", ([], []))
        write_file(folder, scalar_events(epochs, teleports, start))
        return len(epochs)
    tags: set[str] = set()
    written = 0
    for trial, row in sorted(trials.items()):
        epochs, teleports = runs.get(trial, ([], []))
        events = scalar_events(epochs, teleports, start)
        tags |= {v.tag for e in events[1:] for v in e.summary.value}
        state = row.get("state") if ended else None
        first, last = session_events(row.get("config") or {}, state, start)
        write_file(folder / trial, events[:1] + first + events[1:] + last)
        written += len(epochs)
    paths = {k for row in trials.values() for k in (row.get("config") or {})}
    write_file(folder, [Event(wall_time=start, file_version="brain.Event:2"), experiment_event(paths, tags, start)])
    return written
