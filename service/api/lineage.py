"""Continue and fork: a new experiment that starts from a checkpoint of an ended one, with lineage.

The child is queued like any submission (the caller's own job: admission, limits and quotas as for
``POST /v1/experiments``) with three more fields in its job hash, all in Redis so a restarted scheduler or API
sees them: ``parent`` and ``parent_epoch`` (shown in its view) and ``start_from`` (``api_schemas.lineage.StartFrom``:
the parent's checkpoint directory), which the worker reads before its own resume logic: a child that has
checkpoints of its own (it was requeued or retried) goes on from them, else it loads ``start_from``'s. The parent's
hash lists its ``children``.

The parent must be the caller's own experiment (an admin's: anyone's), and the checkpoint a child starts from is
taken through ``api_schemas.gate``: the parent's id as the service makes them, its checkpoint a real directory of its
run with a regular ``checkpoint.pt``, no link below the storage root (the parent's job wrote that directory).

Only an ended parent (succeeded, failed or cancelled) has children: a running job still prunes its checkpoints
to the latest ``TLAB_KEEP_CHECKPOINTS``, while an ended one's are never deleted, so the checkpoint a child starts
from stays for as long as the child may need it (a requeue included).

The child's stream holds its own epochs only; ``curve_records`` joins its ancestors' epochs before its own for
``GET /v1/experiments/{id}/metrics`` and ``plot.png``, so a child's curve starts where its first ancestor's did.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from api_schemas import ExperimentSpec, gate, keys
from api_schemas.jobs import TERMINAL, ExperimentSubmit, JobState, JobView, Role, UserPublic
from api_schemas.lineage import (
    ContinueRequest,
    ForkRequest,
    LineageError,
    StartFrom,
    continue_spec,
    fork_spec,
)
from service.api.admission import admit_experiment
from service.api.deps import State, own_job
from service.api.enqueue import enqueue, known_nodes, never_fits
from service.api.events import records
from service.core.checkpoints import kept_epochs
from service.core.errors import DoesNotFit, InvalidInput, InvalidState, JobNotFound
from service.core.store import Store, demand_of

MAX_ANCESTORS = 100  # parents a curve joins (a longer chain shows its latest 100 ancestors' epochs)
CURVE_KINDS = ("epoch", "teleport")  # the records an ancestor adds to its descendant's curve
# append a child to the parent's JSON list in one call (two children forked at once both stay)
ADD_CHILD = """
local raw = redis.call('HGET', KEYS[1], 'children')
local children = raw and cjson.decode(raw) or {}
table.insert(children, ARGV[1])
redis.call('HSET', KEYS[1], 'children', cjson.encode(children))
return #children
"""




def ended_parent(st: State, user: UserPublic, job_id: str) -> tuple[dict[str, str], dict[int, str]]:
    """The parent's hash and kept checkpoints: 403/404 unless the caller owns it (or is an admin), 404 for a sweep,
    409 while it has not ended or when it kept no checkpoint."""
    data = own_job(st, user, job_id)
    if data.get("kind", "experiment") != "experiment":
        raise JobNotFound(f"{job_id} is a sweep: continue and fork take an experiment (a trial's checkpoint is "
                          "in the sweep's artifacts)", field="id")
    if JobState(data["state"]) not in TERMINAL:
        raise InvalidState(f"experiment {job_id} is {data['state']}: it can be continued or forked once it has "
                           "ended (`tlab cancel` ends it, keeping its checkpoints)", field="id")
    kept = kept_epochs(st.settings, job_id)
    if not kept:
        raise InvalidState(f"experiment {job_id} kept no checkpoint (it ended before its first epoch, or its "
                           "storage is gone): submit its spec again instead", field="id")
    return data, kept


def start_from(st: State, job_id: str, epoch: int, name: str) -> StartFrom:
    """Where the child starts: the parent's checkpoint ``name`` after ``epoch``, through the gate (409 when it is a
    link, lies under one, or lost its file)."""
    root = st.settings.storage_path
    try:
        gate.real_dir(root, gate.job_id(job_id), gate.plain_name(name))
        usable = gate.regular_file(root, job_id, name, "checkpoint.pt")
    except (OSError, gate.Refused):
        usable = False
    if not usable:
        raise InvalidState(f"experiment {job_id}'s checkpoint after epoch {epoch} cannot be used (it is gone, or is "
                           "no plain directory of its run): submit its spec again instead", field="id")
    return StartFrom(job=job_id, epoch=epoch, checkpoint=name)


def submit_child(st: State, user: UserPublic, parent: dict[str, str], spec: ExperimentSpec, start: StartFrom,
                 name: str, idempotency_key: str | None) -> tuple[JobView, bool]:
    """Queue the child as the caller's job (admitted, limited and queued as any submission) and list it among
    the parent's children: (its view, created)."""
    priority = int(parent.get("priority", 0))
    if user.role != Role.ADMIN:  # an admin may have raised the parent's above what the caller may ask for
        priority = min(priority, user.quotas.max_priority)
    body = ExperimentSubmit(spec=spec, name=name[:200], priority=priority, tags=json.loads(parent.get("tags") or "[]"))
    body = admit_experiment(st.settings, user, body)
    view, _ = st.cluster_view()
    why = never_fits(demand_of(body), known_nodes(st.settings.cluster_nodes, view))
    if why:
        raise DoesNotFit(f"the child can never fit the cluster: {why}", field="set.resources")
    extra = {"parent": start.job, "parent_epoch": str(start.epoch), "start_from": start.model_dump_json()}
    job, created = enqueue(st.store, user, body, idempotency_key, extra)
    if created:
        st.store.r.eval(ADD_CHILD, 1, keys.job(start.job), job.id)
        st.submissions.inc()
    return st.store.view(job.id), created


def _refused(err: LineageError) -> InvalidInput:
    return InvalidInput(str(err), field=err.field)


def parent_spec(job_id: str, data: dict[str, str]) -> ExperimentSpec:
    """The parent's spec as stored; 409 when it no longer validates (a job from an older version of the spec)."""
    try:
        return ExperimentSpec.model_validate_json(data["spec"])
    except ValidationError:
        raise InvalidState(f"experiment {job_id}'s spec is not valid under this version of the service: submit "
                           "a corrected spec as a new experiment", field="id") from None


def continue_job(st: State, user: UserPublic, job_id: str, req: ContinueRequest,
                 idempotency_key: str | None = None) -> tuple[JobView, bool]:
    """``POST /v1/experiments/{id}/continue``: ``req.epochs`` more from the parent's final checkpoint."""
    parent, kept = ended_parent(st, user, job_id)
    final = max(kept)
    try:
        spec = continue_spec(parent_spec(job_id, parent), final, req.epochs)
    except LineageError as err:
        raise _refused(err) from None
    start = start_from(st, job_id, final, kept[final])
    return submit_child(st, user, parent, spec, start, f"{parent.get('name') or job_id} +{req.epochs}",
                        idempotency_key)


def fork_job(st: State, user: UserPublic, job_id: str, req: ForkRequest,
             idempotency_key: str | None = None) -> tuple[JobView, bool]:
    """``POST /v1/experiments/{id}/fork``: from the checkpoint after ``req.from_epoch``, with ``req.set``."""
    parent, kept = ended_parent(st, user, job_id)
    if req.from_epoch not in kept:
        raise InvalidState(f"epoch {req.from_epoch} was not kept: experiment {job_id} has checkpoints after epochs "
                           f"{', '.join(map(str, sorted(kept)))} (each run keeps its latest TLAB_KEEP_CHECKPOINTS)",
                           field="from_epoch")
    try:
        spec = fork_spec(parent_spec(job_id, parent), req.from_epoch, req.set)
    except LineageError as err:
        raise _refused(err) from None
    start = start_from(st, job_id, req.from_epoch, kept[req.from_epoch])
    changed = " ".join(f"{k}={json.dumps(v)}" for k, v in req.set.items())
    return submit_child(st, user, parent, spec, start,
                        f"{parent.get('name') or job_id} @{req.from_epoch} {changed}".rstrip(), idempotency_key)


def curve_records(store: Store, job_id: str) -> list[dict[str, Any]]:
    """The job's records, after its ancestors' epoch and teleport records up to where each child started (oldest
    ancestor first); in a child's curve every record carries ``job``, the id of the run that trained it."""
    own = records(store.events(job_id))
    parent, cut = store.r.hmget(keys.job(job_id), ["parent", "parent_epoch"])
    if not parent:
        return own
    chain = [{**r, "job": job_id} for r in own]
    for _ in range(MAX_ANCESTORS):
        if not parent or not cut:
            break
        earlier = [{**r, "job": parent} for r in records(store.events(parent))
                   if r.get("kind") in CURVE_KINDS and isinstance(r.get("epoch"), int) and r["epoch"] < int(cut)]
        chain = earlier + chain
        parent, cut = store.r.hmget(keys.job(parent), ["parent", "parent_epoch"])
    return chain

