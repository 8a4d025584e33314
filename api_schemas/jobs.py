"""The REST contract for jobs, users, the queue and the cluster (requests and responses by role)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.notify import After, Notify
from api_schemas.preflight import PreflightResult
from api_schemas.spec import ExperimentSpec


class JobState(StrEnum):
    """A job's life: queued -> starting -> running -> succeeded | failed | cancelled.

    ``starting`` = the scheduler has chosen it and is submitting its Ray job; a job whose Ray
    cluster vanished mid-run goes back to ``queued`` and resumes from its last checkpoint.
    """

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING})

# from-state -> the states it may move to; terminal states move nowhere.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED,
                                  JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class Role(StrEnum):
    USER = "user"
    ADMIN = "admin"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f]*$")]  # a label: no control chars


class ExperimentSubmit(_Strict):
    """``POST /v1/experiments``: a spec plus how to file it."""

    spec: ExperimentSpec
    name: str = Field("", max_length=200, description="a label for listings; defaults to the job id")
    priority: int = Field(0, ge=-100, le=100, description="higher starts first; fair share orders equal priorities")
    tags: list[Tag] = Field(default_factory=list, max_length=32)
    after: After = Field(default_factory=list)
    notify: Notify | None = Field(None, description="POST a signed JSON to a webhook when the job ends")


class Demand(_Strict):
    """What a job's gang needs: ``workers`` bundles of ``cpus``/``gpus`` each, all at once."""

    workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    gpu_type: str | None = Field(None, description="the GPU model each worker needs (resources.gpu_type); none: any")
    memory_gb: float | None = Field(None, description="host memory each worker needs (resources.memory_gb); none: "
                                                      "not reserved")

    @property
    def cpus(self) -> float:
        return self.workers * self.cpus_per_worker

    @property
    def gpus(self) -> float:
        return self.workers * self.gpus_per_worker

    @property
    def memory(self) -> float:
        """GiB of host memory the whole gang holds (none asked: 0)."""
        return self.workers * (self.memory_gb or 0.0)


class Progress(_Strict):
    epoch: int | None = None
    epochs: int | None = None
    train_loss: float | None = None
    test_loss: float | None = None
    gpu_memory_mb: float | None = Field(None, description="on a GPU: the peak GPU memory (MiB) of the job's rank 0 "
                                                          "so far, as its last epoch reported it")
    gpu_memory_mb_ranks: list[float] | None = Field(None, description="on a GPU with several ranks: each rank's peak "
                                                                      "GPU memory so far (MiB), in rank order")


class JobView(_Strict):
    """One job as the API shows it."""

    id: str
    kind: Literal["experiment", "sweep"] = "experiment"
    name: str
    owner: str
    state: JobState
    priority: int
    tags: list[str]
    spec: ExperimentSpec
    demand: Demand
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_position: int | None = Field(None, description="1 = next to start; only while queued")
    pending_reason: str | None = Field(None, description="why a queued job is not running yet")
    attempts: int = Field(0, description="how many times the scheduler has started it")
    preemptions: int = Field(0, description="how many times a higher-priority job preempted it (each one sent it "
                                           "back to the queue to resume from its checkpoint; not a failure)")
    last_preemption: str | None = Field(None, description="the last preemption: by which job, and when")
    ray_job_id: str | None = None
    progress: Progress = Field(default_factory=Progress)
    summary: dict[str, Any] | None = None
    failure_reason: str | None = None
    after: list[str] = Field(default_factory=list, description="the jobs this one waits for (all must succeed)")
    notify: Notify | None = None
    parent: str | None = Field(None, description="continued or forked from this experiment (its checkpoint)")
    parent_epoch: int | None = Field(None, description="started from the parent's checkpoint after this epoch")
    children: list[str] = Field(default_factory=list, description="experiments continued or forked from this one")
    preflight: PreflightResult | None = Field(None, description="a job that runs your code: its preflight (import, "
                                              "build, one step, one teleport on one CPU) before the gang is held")


class JobList(_Strict):
    items: list[JobView]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null = last page")


class DryRun(_Strict):
    """``POST /v1/experiments?dry_run=true``: would it fit, and where."""

    valid: bool = True
    demand: Demand
    fits_ever: bool
    fits_now: bool
    placement: list[str] = Field(default_factory=list, description="node per worker, if it fits now")
    reason: str | None = None
    preflight: PreflightResult | None = Field(None, description="a spec that runs your code: the preflight's result "
                                              "(run on Ray inside the request); null for built-in specs")


class QueueEntry(_Strict):
    """One queued job. A non-admin sees another user's job only as a position: id, owner, name and reason are null."""

    position: int
    id: str | None = Field(..., description="null for another user's job (unless the caller is an admin)")
    owner: str | None = Field(..., description="null for another user's job (unless the caller is an admin)")
    name: str | None = Field(..., description="null for another user's job (unless the caller is an admin)")
    priority: int
    demand: Demand
    created_at: float
    pending_reason: str | None = None


class QueueView(_Strict):
    items: list[QueueEntry]


class NodeShare(_Strict):
    """What one running job holds on one node: its workers there and their CPUs and GPUs (a share of a card: < 1)."""

    job: str | None = Field(description="the job's id; null: another user's job (an admin sees every id)")
    workers: int
    cpus: float
    gpus: float
    gpu_memory_mb: float | None = Field(None, description="on a GPU: the peak GPU memory so far (MiB) of the job's "
                                                          "ranks on this node, summed, from its last epoch (only rank "
                                                          "0's known: on its node); null before its first epoch")
    memory_gb: float | None = Field(None, description="host memory its workers here hold in Ray (resources.memory_gb "
                                                      "each); null: the job asked for none")


class NodeView(_Strict):
    id: str
    alive: bool = Field(description="false: Ray declared the node dead (kept until a node of the same host and "
                                    "address joins again)")
    hostname: str | None = Field(None, description="the machine's name (its Ray node name); null: not known")
    address: str | None = Field(None, description="the node's IP address; null: not known")
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float
    gpu_type: str | None = Field(None, description="the node's GPU model as Ray names it (resources.gpu_type)")
    memory_gb_total: float | None = Field(None, description="GiB of host memory Ray may reserve on the node (its "
                                                            "'memory' resource); null: not known")
    memory_gb_free: float | None = Field(None, description="GiB of it not reserved (resources.memory_gb of the jobs "
                                                           "here, and never more than Ray reports free); null: not "
                                                           "known")
    jobs: list[NodeShare] = Field(default_factory=list, description="the running jobs' shares of this node")
    leaving: bool = Field(False, description="true: the node is leaving (`tlab leave`): nothing new starts there, and "
                                             "its jobs move elsewhere")


class ClusterView(_Strict):
    nodes: list[NodeView]
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float
    running_jobs: list[str] = Field(description="ids of the running jobs: the caller's own (an admin: all)")
    scheduler_alive: bool
    cpus_outside: float = Field(0.0, description="CPUs Ray reports in use beyond Teleport Lab's running jobs "
                                                 "(other Ray work, or a finished job's workers being released)")
    gpus_outside: float = Field(0.0, description="GPUs Ray reports in use beyond Teleport Lab's running jobs")
    memory_gb_outside: float = Field(0.0, description="GiB of memory Ray reports reserved beyond Teleport Lab's "
                                                      "running jobs")
    memory_gb_total: float | None = Field(None, description="GiB of host memory Ray may reserve on the nodes whose "
                                                            "memory is known; null: none known")
    memory_gb_free: float | None = Field(None, description="GiB of it not reserved; null: none known")
    sandbox: str = Field("", description="where a job's code runs (docs/security.md): 'on' (each job in a sandbox of "
                                         "its own), 'off' (TLAB_SANDBOX=off: beside the control plane), or "
                                         "'unavailable: <why>' (users' code is refused at submit)")


class Quotas(_Strict):
    max_gpus: float = Field(8, ge=0, description="GPUs the user's starting/running jobs may hold at once")
    max_running_jobs: int = Field(4, ge=1, description="jobs the user may have starting/running at once")
    max_queued_jobs: int = Field(100, ge=0, description="jobs the user may have queued at once (more: 429 with "
                                                        "Retry-After)")
    max_priority: int = Field(0, ge=-100, le=100, description="the highest priority the user may give a job "
                                                              "(admins may raise it; admins themselves are not bound)")
    max_cpus: float = Field(64, ge=0, description="CPUs the user's starting/running jobs may hold at once (a gang "
                                                  "over it alone is refused at submit)")
    max_memory_gb: float | None = Field(None, gt=0, description="GiB of host memory (resources.memory_gb x "
                                                                "workers) the user's starting/running jobs may "
                                                                "hold at once (a gang over it alone is refused at "
                                                                "submit); none: no limit")
    max_time_limit_s: float = Field(7 * 86400, gt=0, description="the longest resources.time_limit_s the user may "
                                                                 "ask for (admins are not bound)")
    max_unpreemptible: int = Field(1, ge=0, description="jobs with resources.preemptible=false the user may have "
                                                        "queued or running at once (admins are not bound)")
    max_storage_gb: float | None = Field(None, gt=0, description="GB of storage the user's ended jobs may hold "
                                                                 "(checkpoints, artifacts, logs); at or over it a "
                                                                 "submit is refused; none: no limit")


class UserCreate(_Strict):
    name: str = Field(..., pattern=r"^[a-z][a-z0-9_.-]{0,62}$", description="lower-case login name")
    role: Role = Role.USER
    quotas: Quotas = Field(default_factory=Quotas)
    can_submit_code: bool = False


class UserPublic(_Strict):
    name: str
    role: Role
    quotas: Quotas
    created_at: float
    can_submit_code: bool = Field(False, description="may submit jobs that run an uploaded code package")
    disabled: bool = Field(False, description="a disabled user's tokens are refused (401)")
    token_rotated_at: float | None = Field(None, description="when the current token was issued by a rotation")
    storage_used_gb: float | None = Field(None, description="GET /v1/me: GB of storage your ended jobs hold")


def _quota_change_schema(schema: dict[str, Any]) -> None:
    """``UserUpdate.quotas`` in the JSON Schema: some of Quotas' fields, with their bounds and no defaults (a field
    left out stays as it is), or null."""
    change = Quotas.model_json_schema()
    for prop in change["properties"].values():
        prop.pop("default", None)
    change.update(title="QuotasChange", description="quota fields to change (see Quotas); the rest stay")
    schema.pop("anyOf", None)
    schema["anyOf"] = [change, {"type": "null"}]


class UserUpdate(_Strict):
    """``PATCH /v1/users/{name}`` (admin): only the fields given change; ``quotas`` merges field by field."""

    quotas: dict[str, Any] | None = Field(None, description="quota fields to change (see Quotas); the rest stay",
                                          json_schema_extra=_quota_change_schema)
    can_submit_code: bool | None = None
    disabled: bool | None = Field(None, description="true refuses the user's tokens at once; false lets them in")


class UserCreated(_Strict):
    user: UserPublic
    token: str = Field(..., description="shown once; only its hash is stored")


class MetricsView(_Strict):
    """``GET /v1/experiments/{id}/metrics``: per-epoch rows (downsampled to ``max_points``)."""

    id: str
    total_points: int
    points: list[dict[str, Any]]
    teleports: list[dict[str, Any]]


class TrialRow(_Strict):
    trial: str
    config: dict[str, Any]
    state: str
    epochs: int
    last: float | None = None
    best: float | None = None
    stopped_early: bool = False
    reason: str | None = Field(None, description="a failed trial: why, in one line")
    perturbed: int = Field(0, description="PBT: times the trial went on from a top trial's checkpoint with "
                                          "mutated values (config is the latest)")
    reruns: int = Field(0, description="times the trial was run again by POST /v1/sweeps/{id}/rerun")
    rerun: bool = Field(False, description="named by the sweep's latest rerun")
    summary: dict[str, float | int | None] = Field(
        default_factory=dict, description="the run summary as of the trial's latest epoch (final_train_loss, "
                                          "epochs_to_target, seconds, teleport_share, ...)")


class SweepView(_Strict):
    """``GET /v1/sweeps/{id}``: the sweep's job, its trials table and the best trial so far."""

    job: JobView
    metric: str
    mode: str
    trials: list[TrialRow]
    best: TrialRow | None = None


class StudyGroup(_Strict):
    """Trials that differ only in ``training.seed``: their summaries, mean ± std over seeds."""

    label: str
    config: dict[str, Any]
    trials: list[str]
    stats: dict[str, dict[str, float | int | None]]
    runs: list[dict[str, float | int | None]]


class StudyView(_Strict):
    """``GET /v1/sweeps/{id}/study``: the paper-style table of a sweep, one row per setting of the
    non-seed parameters (``tlab compare`` prints ``table``)."""

    id: str
    seeds: int
    target_loss: float | None
    groups: list[StudyGroup]
    table: str
