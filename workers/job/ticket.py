"""A job's Redis credential, from the one-time ticket the scheduler put in its Ray job's runtime_env.

A Ray job's runtime_env can be read by every job's code (Ray's Jobs API, with the cluster's token), so the scheduler
never puts a job's ``REDIS_URL`` there: ``TLAB_JOB_TICKET`` is the URL of a ticket user allowed nothing but
reading-and-deleting one key (``GETDEL keys.ticket(user)``) that holds it (service/launch/job_acl.py). The job's first
process (its driver, or its preflight) redeems the ticket at start with ``job_redis_url()`` and hands the URL on as an
argument: to its gang's ranks as a task argument, to Tune's trials in their closure, to a TorchTrainer's workers in
``train_loop_config``, never in a runtime_env. Redeemed, the ticket opens nothing; one that someone else redeemed first
stops the job at start with one line (``TicketTaken``). Run without the service (``tlab run``, tests,
``TLAB_JOB_REDIS_ACL=off``) there is no ticket: ``REDIS_URL`` as given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import parse_qs, urlsplit

from api_schemas import keys

TICKET = keys.JOB_TICKET_ENV
_redeemed: dict[str, str] = {}  # ticket -> the URL it gave this process (a ticket is redeemed once per process)


class TicketError(RuntimeError):
    """The job's ticket gave no Redis URL: the job cannot start (what its first process catches)."""


class TicketTaken(TicketError):
    """The job's ticket was redeemed already, or no longer opens anything: the job must not start."""


class TicketUnreadable(TicketError):
    """Redis did not answer while the job redeemed its ticket: the job cannot start (a later attempt may)."""


def ticket_user(url: str) -> str:
    """The Redis user a URL names (``redis://user:pw@host/0``, or ``unix://path?username=user&...``)."""
    parts = urlsplit(url)
    return parts.username or (parse_qs(parts.query).get("username") or [""])[0]


def redeem(ticket: str) -> str:
    """The job's ``REDIS_URL``, read and deleted at once with the ticket's user (``TicketTaken`` if gone)."""
    from redis.exceptions import AuthenticationError, ConnectionError, TimeoutError

    from workers.job.record import connect  # rides out a Redis restart (the scheduler makes the user again)

    user = ticket_user(ticket)
    client = connect(ticket, decode_responses=True)
    try:
        url = client.getdel(keys.ticket(user))
    except AuthenticationError:
        raise TicketTaken(f"this job's Redis ticket ({user}) opens nothing: its attempt is over") from None
    except (ConnectionError, TimeoutError) as err:
        raise TicketUnreadable(f"Redis did not answer while this job redeemed its ticket ({user}): {err}") from None
    finally:
        client.close()
    if not url:
        raise TicketTaken(f"this job's one-time Redis ticket ({user}) was redeemed already, by another process "
                          "that read it from the Ray job's runtime_env: the job stops rather than share its "
                          "credentials (an admin can look at who lists Ray jobs; submit it again)")
    return str(url)


def job_redis_url(environ: Mapping[str, str] = os.environ) -> str:
    """This process's Redis URL for its job: its ticket's (redeemed at the first call), else ``REDIS_URL``, else
    ''. A process started from the job's runtime_env that did not redeem it (a worker) has only the ticket, spent."""
    ticket = environ.get(TICKET)
    if not ticket:
        return environ.get("REDIS_URL", "")
    if ticket not in _redeemed:
        _redeemed[ticket] = redeem(ticket)
    return _redeemed[ticket]


def redeemed() -> str:
    """The URL this process redeemed its ticket for ('' if it did not): for what Tune restores from its saved state,
    which must not hold it (``workers.sweep.TrialTable``)."""
    ticket = os.environ.get(TICKET, "")
    return _redeemed.get(ticket, "")
