"""A sweep's rerun in its driver: the trials the service marked (``service/api/sweep_rerun.py``) run again.

``Tuner.restore`` decides per trial *status* what to do (resume unfinished trials, resume or skip errored ones),
not per trial. So before restoring, ``resume_only`` rewrites the statuses in Tune's newest experiment state file
(``experiment_state-*.json``: ``trial_data`` is a list of ``[trial JSON, run metadata JSON]``, the trial JSON a
plain object with ``trial_id`` and ``status``): a marked trial that errored becomes ``PENDING``, i.e. unfinished,
which ``resume_unfinished`` resumes under its id from its last checkpoint, as Tune does after a crash (from
scratch when it kept none); errored trials not marked stay ``ERROR`` (``resume_errored=False`` skips them).
Unfinished trials (cut off when the sweep ended: the service marks them all, see there) resume as after a crash.
A restart of the rerun's driver (its Ray job vanished) does the same again: the marks stay in the rows until the
next rerun.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

from api_schemas import gate, keys
from api_schemas.reasons import one_line
from workers.job.harness import SetupError


def marked_trials(client: Any, job_id: str) -> set[str]:
    """The trials the latest rerun named, read from the trials table. The job's code can write that table: a row
    counts only when it is a JSON object whose ``trial`` is a trial id (``api_schemas.gate.trial_id``) and its own
    field's name; any other marked row is dropped, with a line in the job's log."""
    marked = set()
    for field, raw in client.hgetall(keys.trials(job_id)).items():
        try:
            row = json.loads(raw)
            if not isinstance(row, dict) or not row.get("rerun"):
                continue
            trial = gate.trial_id(row.get("trial"))
            if trial != field:
                raise gate.Refused(f"trial id {trial!r} refused: its row is {str(field)[:80]!r}'s")
        except ValueError as err:  # (gate.Refused and a row that is no JSON are ValueErrors)
            print(f"[tlab] rerun: a trials row left out: {one_line(str(err))}", file=sys.stderr, flush=True)
            continue
        marked.add(trial)
    return marked


def state_gone(path: str) -> SetupError:
    return SetupError(f"rerun: no Tune experiment state in {path}: the sweep's storage was cleaned, so its trials "
                      "cannot resume; submit the sweep again")


def newest_state(path: str) -> str:
    found = sorted(glob.glob(os.path.join(glob.escape(path), "experiment_state-*.json")))
    if not found:
        raise state_gone(path)
    return found[-1]  # Tune's own choice (_find_newest_experiment_checkpoint): the greatest name


def resume_only(path: str, rerun: set[str]) -> list[str]:
    """Rewrite the newest experiment state so a restore resumes the errored trials of ``rerun`` (module doc); the
    ids of ``rerun`` Tune will run (a marked trial that already finished in this rerun will not)."""
    state_file = newest_state(path)
    with open(state_file) as f:
        state = json.load(f)
    resumed = []
    for entry in state["trial_data"]:
        trial = json.loads(entry[0])
        if trial.get("trial_id") not in rerun or trial.get("status") == "TERMINATED":
            continue
        resumed.append(trial["trial_id"])
        if trial.get("status") == "ERROR":
            trial["status"] = "PENDING"
            entry[0] = json.dumps(trial, indent=2)
    tmp = f"{state_file}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, state_file)
    return resumed
