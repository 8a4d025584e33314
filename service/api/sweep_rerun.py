"""``POST /v1/sweeps/{id}/rerun``: run some trials of an ended sweep again, inside the same sweep.

The sweep keeps its id, trials table and Tune experiment: the service marks the chosen rows (``state`` queued,
``rerun`` true, ``reruns`` + 1) and puts the sweep back in the queue in one Lua call (``RERUN``: the
``max_queued_jobs`` cap as at submit, the ended run's fields cleared, its ``end`` events dropped so a follower goes
on into the rerun). The scheduler starts it as any queued job (quotas, fair share, dependencies); its driver
(``workers.sweep``, ``workers.on_ray.sweep_rerun``) restores Tune's experiment and resumes the marked trials from their
last checkpoints, the others keep their rows, and the best trial and summary are worked out again over them all.

A trial can be rerun when it failed, or when the sweep ended (cancelled, its time limit) before it did: such a row
still says running or pending and is shown ``cancelled``; a rerun always takes every cut-off trial along (``chosen``
says why). No FastAPI here.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from api_schemas import keys
from api_schemas.jobs import TERMINAL, JobView, Role, TrialRow, UserPublic
from api_schemas.redis_scripts import RERUN
from api_schemas.sweeps import SweepRerun, SweepSubmit
from service.api.admission import admit_sweep
from service.api.enqueue import known_nodes, never_fits
from service.core.errors import DoesNotFit, InvalidInput, InvalidState, TooManyRequests
from service.core.store import QUEUED_RETRY_S, Store, demand_of
from service.rules.limits import TIME_LIMITED
from service.rules.preemptible import PREEMPTED_BY, PREEMPTED_PRIORITY

if TYPE_CHECKING:
    from service.api.deps import State

UNFINISHED = ("running", "pending", "queued")  # row states of a trial that had not ended when its sweep did
RERUNNABLE = ("failed", "cancelled")
# the ended run's job hash fields: a rerun starts without them (started_at, ray_job_id, attempts: set at its start)
CLEARED = ("finished_at", "failure_reason", "summary", "cancel_requested", TIME_LIMITED, "ran_s", "resume_free",
           PREEMPTED_BY, PREEMPTED_PRIORITY)


def shown_rows(rows: list[TrialRow], sweep_state: str) -> list[TrialRow]:
    """The rows as the API shows them: once the sweep has ended, a trial that had not is ``cancelled``."""
    if sweep_state not in TERMINAL:
        return rows
    return [r.model_copy(update={"state": "cancelled"}) if r.state in UNFINISHED else r for r in rows]


def chosen(rows: list[TrialRow], asked: Any, sweep_id: str) -> list[str]:
    """The trial ids to run again: those ``trials`` names (each failed or cut off: else 422 naming ``trials``), and
    every trial the sweep's end cut off, which goes on with it whatever is named: Tune's search goes on from where
    it stopped, and a cut-off trial left out would hold its place in the search for good."""
    cut_off = [r.trial for r in rows if r.state == "cancelled"]
    if asked == "failed":
        ids = [r.trial for r in rows if r.state == "failed"] + cut_off
        if not ids:
            states = ", ".join(sorted({r.state for r in rows})) or "none reported"
            raise InvalidInput(f"sweep {sweep_id} has no failed or cancelled trial to rerun (its trials: {states})",
                               field="trials")
        return sorted(ids)
    by_id = {r.trial: r for r in rows}
    for trial in asked:
        row = by_id.get(trial)
        if row is None:
            known = ", ".join(sorted(by_id)[:20]) or "none"
            raise InvalidInput(f"sweep {sweep_id} has no trial {trial!r} (its trials: {known})", field="trials")
        if row.state not in RERUNNABLE:
            raise InvalidInput(f"trial {trial} {row.state}: only a failed or cancelled trial can be rerun",
                               field="trials")
    return sorted({*asked, *cut_off})


def marked(raw: dict[str, str], ids: list[str]) -> dict[str, str]:
    """Every row to write: the chosen ones queued (``rerun``, ``reruns`` + 1), the rest with ``rerun`` false;
    everything else in a row as the driver wrote it."""
    out = {}
    for trial, text in raw.items():
        data = json.loads(text)
        if trial in ids:
            data.update(state="queued", rerun=True, reruns=int(data.get("reruns") or 0) + 1)
        else:
            data["rerun"] = False
        out[trial] = json.dumps(data)
    return out


def admitted(st: State, user: UserPublic, sweep_id: str, data: dict[str, str]) -> None:
    """The stored sweep admitted again as the caller's submit would be (limits, quotas, code) and still fitting
    the cluster: what changed since it was submitted applies to its rerun."""
    body = admit_sweep(st.settings, user, SweepSubmit.model_validate_json(data["sweep"]))
    view, _ = st.cluster_view()
    why = never_fits(demand_of(body), known_nodes(st.settings.cluster_nodes, view))
    if why:
        raise DoesNotFit(f"max_concurrent_trials={body.max_concurrent_trials} trials at once can never fit the "
                         f"cluster now: {why}", field="id")


def requeue(store: Store, user: UserPublic, data: dict[str, str], rows: dict[str, str], reason: str) -> None:
    """The RERUN script: 409 if the sweep left its ended state meanwhile, 429 at the caller's queued cap."""
    sweep_id, owner = data["id"], data["owner"]
    cap = -1 if user.role == Role.ADMIN else user.quotas.max_queued_jobs
    args: list[Any] = [sweep_id, repr(time.time()), ",".join(s.value for s in TERMINAL), reason, cap,
                       keys.job(""), len(CLEARED), *CLEARED]
    for trial, row in rows.items():
        args += [trial, row]
    status, value = store.r.eval(RERUN, 8, keys.job(sweep_id), keys.queue(), keys.events(sweep_id), keys.wake(),
                                 keys.trials(sweep_id), keys.job_run(sweep_id), "", keys.user_queued(owner), *args)
    if int(status) == 2:
        raise TooManyRequests(f"a rerun queues the sweep again, and you have {value} jobs queued (your "
                              "max_queued_jobs quota): rerun once some have started, or cancel some",
                              field="max_queued_jobs", retry_after_s=QUEUED_RETRY_S)
    if int(status) != 1:
        raise InvalidState(f"sweep {sweep_id} is {value}: only an ended sweep can rerun trials", field="id")


def rerun_sweep(st: State, user: UserPublic, sweep_id: str, data: dict[str, str], req: SweepRerun) -> JobView:
    """Check, mark and queue (module doc); the sweep's view, queued."""
    state = data["state"]
    if state not in TERMINAL:
        raise InvalidState(f"sweep {sweep_id} is {state}: its trials can be rerun once it has ended (cancel it "
                           "first, or wait)", field="id")
    raw = st.store.r.hgetall(keys.trials(sweep_id))
    shown = shown_rows(sorted((TrialRow.model_validate_json(v) for v in raw.values()), key=lambda t: t.trial),
                       state)
    ids = chosen(shown, req.trials, sweep_id)
    admitted(st, user, sweep_id, data)
    shown_ids = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
    reason = f"rerun of trial{'s' if len(ids) > 1 else ''} {shown_ids} (asked by {user.name})"
    requeue(st.store, user, data, marked(raw, ids), reason)
    return st.store.view(sweep_id)

