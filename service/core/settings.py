"""One Settings object for the API, the scheduler and ``tlab up``: environment variables, checked at start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from objstore import is_uri


def default_home() -> Path:
    """``~/.tlab``; for root, ``/var/lib/tlab`` (as PostgreSQL keeps ``/var/lib/postgresql``): a root ``tlab up``
    runs its Ray head as the service user, who must reach the storage, and root's home is closed to others."""
    return Path("/var/lib/tlab") if os.geteuid() == 0 else Path("~/.tlab").expanduser()


class Settings(BaseSettings):
    """Every knob is an environment variable: ``REDIS_URL``, ``RAY_ADDRESS``, ``TLAB_HOME``, ``TLAB_*``."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias="REDIS_URL")
    ray_address: str = Field("http://127.0.0.1:8265", validation_alias="RAY_ADDRESS",
                             description="the Ray dashboard (Jobs API) address")
    home: Path = Field(default_factory=default_home, validation_alias="TLAB_HOME")
    storage: str = Field("", validation_alias="TLAB_STORAGE",
                         description="checkpoints, artifacts, logs: a path every Ray node sees (default "
                                     "$TLAB_HOME/storage), or a bucket URI s3://bucket/prefix?endpoint_override="
                                     "host:port&scheme=http (docs/operations.md, Storage)")
    storage_cache: str = Field("", validation_alias="TLAB_STORAGE_CACHE",
                               description="with a bucket as TLAB_STORAGE: the local working copy on each node "
                                           "(default $TLAB_HOME/storage)")
    bind: str = Field("127.0.0.1", validation_alias="TLAB_BIND")
    port: int = Field(8470, validation_alias="TLAB_PORT")
    join_address: str = Field("", validation_alias="TLAB_JOIN_ADDRESS",
                              description="the Ray head's GCS address (host:port) a node joining with a join token "
                                          "is given; `tlab up --listen` sets it (empty: the API lets no node join)")
    # scheduler
    tick_s: float = Field(1.0, gt=0, validation_alias="TLAB_TICK_S",
                          description="the scheduler decides at least this often (and at once on submit/cancel)")
    half_life_s: float = Field(3600.0, gt=0, validation_alias="TLAB_FAIRSHARE_HALF_LIFE_S")
    start_charge_s: float = Field(60.0, ge=0, validation_alias="TLAB_START_CHARGE_S",
                                  description="usage charged when a job starts, as seconds of its gang")
    max_attempts: int = Field(3, ge=1, validation_alias="TLAB_MAX_ATTEMPTS",
                              description="times a job is restarted after its Ray job vanished")
    stop_grace_s: float = Field(30.0, ge=0, validation_alias="TLAB_STOP_GRACE_S",
                                description="SIGTERM-to-SIGKILL time for a cancelled running job")
    preemption: bool = Field(True, validation_alias="TLAB_PREEMPTION",
                             description="on: a queued job that cannot fit may preempt running jobs of strictly "
                                         "lower priority (docs/operations.md, Preemption); off: it waits")
    starting_timeout_s: float = Field(600.0, gt=0, validation_alias="TLAB_STARTING_TIMEOUT_S")
    default_time_limit_s: float = Field(86400.0, gt=0, validation_alias="TLAB_DEFAULT_TIME_LIMIT_S",
                                        description="a job's running time limit when its spec gives none")
    max_time_limit_s: float = Field(7 * 86400.0, gt=0, validation_alias="TLAB_MAX_TIME_LIMIT_S",
                                    description="the longest resources.time_limit_s anyone may ask for (422 above)")
    default_memory_gb: float | None = Field(None, gt=0, le=65536, validation_alias="TLAB_DEFAULT_MEMORY_GB",
                                            description="resources.memory_gb of a job whose spec gives none, set at "
                                                        "submit: reserved, placed and held as if asked; unset: such "
                                                        "a job reserves none and is not held")
    keep_checkpoints: int = Field(2, ge=1, validation_alias="TLAB_KEEP_CHECKPOINTS",
                                  description="checkpoints Ray Train keeps per job (the latest ones)")
    keep_ended_checkpoints: int = Field(1, ge=1, validation_alias="TLAB_KEEP_ENDED_CHECKPOINTS",
                                        description="checkpoints an ended experiment keeps (its newest, and any a "
                                                    "continue or fork names); its artifacts stay too")
    history_days: float | None = Field(None, gt=0, allow_inf_nan=False, validation_alias="TLAB_HISTORY_DAYS",
                                       description="an ended job is deleted with its files this many days after it "
                                                   "ended, as DELETE would (not while a continued or forked child "
                                                   "runs); unset: kept until its owner deletes it")
    code_ttl_days: float | None = Field(None, gt=0, allow_inf_nan=False, validation_alias="TLAB_CODE_TTL_DAYS",
                                        description="an uploaded code package that no job refers to is deleted this "
                                                    "many days after its upload (or its last re-upload); unset: kept")
    min_free_gb: float = Field(1.0, ge=0, allow_inf_nan=False, validation_alias="TLAB_MIN_FREE_GB",
                               description="below this much free space on the storage volume no job starts (they "
                                           "wait, saying why); 0: never checked")
    max_job_gb: float = Field(100.0, gt=0, allow_inf_nan=False, validation_alias="TLAB_MAX_JOB_GB",
                              description="a running job whose files on the storage volume hold more is stopped and "
                                          "ends failed saying so (its last checkpoint kept); so is one that takes "
                                          "its owner past quotas.max_storage_gb")
    max_job_files: int = Field(100_000, gt=0, validation_alias="TLAB_MAX_JOB_FILES",
                               description="a running job whose files on the storage volume count more entries (files, "
                                           "directories, links) is stopped and ends failed saying so (its last "
                                           "checkpoint kept); the scheduler's measure reads at most this many")
    storage_check_s: float = Field(30.0, gt=0, allow_inf_nan=False, validation_alias="TLAB_STORAGE_CHECK_S",
                                   description="how often the scheduler measures each running job's files")
    checkpoint_every_s: float = Field(2.0, ge=0, allow_inf_nan=False, validation_alias="TLAB_CHECKPOINT_EVERY_S",
                                      description="a job's driver writes an epoch's checkpoint only this long after "
                                                  "its last write (0: every epoch); the last ones at its end or stop")
    max_failures: int = Field(3, ge=0, validation_alias="TLAB_MAX_FAILURES",
                              description="Ray Train worker restarts within one attempt")
    cluster_nodes: str = Field("", validation_alias="TLAB_CLUSTER_NODES",
                               description="JSON list of {id, cpus, gpus}: a fixed cluster instead of Ray's "
                                           "(simulations and benchmarks)")
    heartbeat_s: float = Field(15.0, gt=0, validation_alias="TLAB_SSE_HEARTBEAT_S")
    # admission: what one request may ask for (service/api/admission.py, docs/rest.md "Limits")
    data_roots: str = Field("", validation_alias="TLAB_DATA_ROOTS",
                            description="colon-separated directories the service reads datasets from "
                                        "(default $TLAB_HOME/data); a relative dataset.root is looked up in each")
    max_body_bytes: int = Field(1 << 20, ge=1024, validation_alias="TLAB_MAX_BODY_BYTES",
                                description="largest JSON request body (413 above it)")
    max_epochs: int = Field(1000, ge=1, validation_alias="TLAB_MAX_EPOCHS")
    max_width: int = Field(16384, ge=1, validation_alias="TLAB_MAX_WIDTH",
                           description="units or channels of one layer; a transformer's heads x head_dim x mlp_ratio")
    max_layers: int = Field(128, ge=1, validation_alias="TLAB_MAX_LAYERS")
    max_teleport_batches: int = Field(2000, ge=1, validation_alias="TLAB_MAX_TELEPORT_BATCHES",
                                      description="teleport.batches x the teleport epochs within training.epochs")
    max_teleport_steps: int = Field(1000, ge=1, validation_alias="TLAB_MAX_TELEPORT_STEPS")
    min_cpus_per_worker: float = Field(0.1, gt=0, validation_alias="TLAB_MIN_CPUS_PER_WORKER")
    max_trials: int = Field(1000, ge=1, validation_alias="TLAB_MAX_TRIALS", description="trials of one sweep")
    max_streams_per_user: int = Field(16, ge=1, validation_alias="TLAB_MAX_STREAMS_PER_USER",
                                      description="SSE streams one user may hold open per API process (429 above)")
    max_streams: int = Field(1000, ge=1, validation_alias="TLAB_MAX_STREAMS",
                             description="SSE streams (events and logs) one API process holds open, all users "
                                         "together (429 above)")
    redis_pool: int = Field(64, ge=2, validation_alias="TLAB_REDIS_POOL",
                            description="async Redis connections per API process (SSE: one reader for every "
                                        "followed job, plus short reads); a request waits for one when all are busy")
    max_compare: int = Field(8, ge=1, validation_alias="TLAB_MAX_COMPARE", description="runs in one plot.png")
    # users' code packages (service/core/code_store.py, docs/operations.md "User code")
    user_code: bool = Field(True, validation_alias="TLAB_USER_CODE",
                            description="on: jobs may run the user's code (packages, factories, loss functions)")
    sandbox: Literal["auto", "on", "off"] = Field(
        "auto", validation_alias="TLAB_SANDBOX",
        description="a job's training runs in a bubblewrap sandbox (docs/security.md): auto probes this machine and "
                    "refuses users' code where none can run; on: the Ray nodes have one (not probed here); off: none, "
                    "knowingly (service/core/sandbox_state.py)")
    sandbox_tmp_mb: int = Field(1024, ge=16, validation_alias="TLAB_SANDBOX_TMP_MB",
                                description="a sandboxed job's private /tmp: a tmpfs (memory) of at most this many MB")
    service_user: str = Field("tlab", min_length=1, validation_alias="TLAB_SERVICE_USER",
                              description="tlab up as root: the unprivileged user its Ray head (every Ray worker and "
                                          "job supervisor) runs as; made with useradd --system when missing; off: "
                                          "Ray runs as root, knowingly (service/stack/service_user.py)")
    runtime_dir: str = Field("", validation_alias="TLAB_RUNTIME_DIR",
                             description="tlab up as root, with a Python the service user cannot read (under /root): "
                                         "where a copy it can read is made once (default /opt/tlab/runtime-<python "
                                         "version>; service/stack/runtime.py)")
    job_redis_acl: bool = Field(True, validation_alias="TLAB_JOB_REDIS_ACL",
                                description="on: each job reaches Redis as its own ACL user, allowed only its "
                                            "own keys (service/launch/job_acl.py); off: with the service's REDIS_URL")
    max_code_mb: float = Field(50.0, gt=0, validation_alias="TLAB_MAX_CODE_MB",
                               description="largest code package (the zip) in MiB (413 above it)")
    max_code_unpacked_mb: float = Field(200.0, gt=0, validation_alias="TLAB_MAX_CODE_UNPACKED_MB",
                                        description="largest total size of a package's files unpacked, in MiB "
                                                    "(422 above it: a zip bomb)")
    redis_maxmemory_mb: int = Field(1024, ge=16, validation_alias="TLAB_REDIS_MAXMEMORY_MB",
                                    description="tlab up's Redis: its maxmemory, with policy noeviction (a write "
                                                "over it is refused, no key is ever evicted)")
    job_redis_mb: float = Field(64.0, gt=0, validation_alias="TLAB_JOB_REDIS_MB",
                                description="what one job's keys (events, run, trials) may hold in Redis; over it "
                                            "the scheduler refuses its writes and trims its stream")
    code_max_files: int = Field(10_000, ge=1, validation_alias="TLAB_CODE_MAX_FILES",
                                description="most members (files and directories) in one code package (422 above)")
    preflight_timeout_s: float = Field(120.0, gt=0, validation_alias="TLAB_PREFLIGHT_TIMEOUT_S",
                                       description="a preflight's time box, from its submit to Ray to its verdict "
                                                   "(runtime env and pip install included); over it the job fails")
    preflight_max: int = Field(4, ge=1, validation_alias="TLAB_PREFLIGHT_MAX",
                               description="preflights the scheduler runs at once (1 CPU each), and dry runs with "
                                           "code one API process runs at once (429 above)")
    # notifications (service/scheduler/notify.py, docs/operations.md "Webhooks")
    webhook_allow: str = Field("", validation_alias="TLAB_WEBHOOK_ALLOW",
                               description="comma-separated host names webhooks may go to (empty: any)")
    public_url: str = Field("", validation_alias="TLAB_PUBLIC_URL",
                            description="the API's URL as users reach it, for links in webhooks (default: "
                                        "http://TLAB_BIND:TLAB_PORT)")
    webhook_timeout_s: float = Field(5.0, gt=0, le=60, validation_alias="TLAB_WEBHOOK_TIMEOUT_S")
    webhook_attempts: int = Field(3, ge=1, le=10, validation_alias="TLAB_WEBHOOK_ATTEMPTS",
                                  description="tries per webhook (1 s, 2 s, ... apart)")
    # researchers' tools (service/scheduler/trackers.py, docs/mlflow.md)
    mlflow_tracking_uri: str = Field("", validation_alias="TLAB_MLFLOW_TRACKING_URI",
                                     description="an MLflow tracking server the scheduler logs every job to (its "
                                                 "credentials: MLflow's own MLFLOW_TRACKING_* variables, which no job "
                                                 "sees); empty: none")

    @property
    def storage_path(self) -> str:
        """The local storage directory every part reads and writes (with a bucket: its working copy)."""
        if self.storage_uri:
            return self.storage_cache or str(self.home / "storage")
        return self.storage or str(self.home / "storage")

    @property
    def storage_uri(self) -> str:
        """TLAB_STORAGE when it is a bucket URI (``objstore``), else ''."""
        return self.storage if is_uri(self.storage) else ""

    @property
    def webhook_hosts(self) -> set[str]:
        """TLAB_WEBHOOK_ALLOW as lower-case host names (empty: any host)."""
        return {h.strip().lower() for h in self.webhook_allow.split(",") if h.strip()}

    @property
    def data_root_paths(self) -> list[Path]:
        """The data roots, resolved (symlinks and ``..``), in the order a relative dataset.root is looked up."""
        given = [p for p in self.data_roots.split(":") if p.strip()] or [str(self.home / "data")]
        return [Path(p).expanduser().resolve() for p in given]
