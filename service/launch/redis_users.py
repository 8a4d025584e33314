"""The names of a job's Redis ACL users, shared by the job's own (``service.launch.job_acl``) and its preflight's
(``service.launch.preflight_jobs``), which both make, restore and delete them:

- ``tlab-job-<id>``: the job's user (``user_name``), which ``JobAcl.sync`` keeps to the active jobs;
- ``tlab-preflight-<id>``: its preflight's (``preflight_user``), a name ``JobAcl.sync`` leaves alone;
- ``tlab-ticket-job-<id>``, ``tlab-ticket-preflight-<id>``: each one's one-time ticket user (``ticket_user``).
"""

from __future__ import annotations

USER_PREFIX = "tlab-job-"
PREFLIGHT_PREFIX = "tlab-preflight-"
TICKET_PREFIX = "tlab-ticket-"


def user_name(job_id: str) -> str:
    return f"{USER_PREFIX}{job_id}"


def preflight_user(job_id: str) -> str:
    return f"{PREFLIGHT_PREFIX}{job_id}"


def ticket_user(user: str) -> str:
    """The ticket user of the job's user ``user``: ``tlab-ticket-job-<id>`` (a preflight's: ``-preflight-<id>``)."""
    return f"{TICKET_PREFIX}{user.removeprefix('tlab-')}"
