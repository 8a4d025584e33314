"""What every route shares: the app's State, the caller (bearer token), ownership checks, list parameters.

Routes take them as ``Annotated`` aliases (``st: StateDep, user: CurrentUser``), the FastAPI template's way.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import AsyncIterator
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Histogram

from api_schemas import keys
from api_schemas.jobs import ClusterView, JobState, Role, UserPublic
from service.api.events import Hub
from service.api.views import JobFilter, Page, read_cluster_view
from service.core.errors import Forbidden, JobNotFound, TooManyRequests, Unauthorized
from service.core.settings import Settings
from service.core.store import Store

JOB_ID = re.compile(keys.JOB_ID_PATTERN)
STREAM_RETRY_S = 10  # Retry-After when a user, or the process, holds the most SSE streams: a closed one frees its slot
ASYNC_CLIENT_NAME = "tlab-api-async"  # the API's async pool in Redis's CLIENT LIST (SSE, token re-checks)
USER_CACHE_S = 5.0  # a token's user is re-read at least this often (and at once when the auth generation moves)
CLUSTER_CACHE_S = 0.5  # the scheduler's published cluster view is re-read at most this often


class State:
    """One per API process (``app.state.tlab``): the store, the async Redis for SSE, metrics, small caches."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store.from_url(settings.redis_url)
        # a blocking pool: a burst of followers waits for a connection instead of failing with "Too many
        # connections"; live events hold one for every followed job together (the Hub), history reads are short
        self.aredis = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.redis_pool, timeout=30, decode_responses=True,
            client_name=ASYNC_CLIENT_NAME))
        self.hub = Hub(self.aredis)
        self.registry = CollectorRegistry()
        self.requests = Counter("tlab_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("tlab_http_request_seconds", "HTTP request latency", ["route"],
                                 registry=self.registry,
                                 buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.submissions = Counter("tlab_submissions", "experiments accepted", registry=self.registry)
        self._jobs_client: Any = None
        self._users: dict[str, tuple[UserPublic, float, int]] = {}  # token -> (user, expiry, auth generation)
        self._cluster: tuple[tuple[ClusterView | None, float], float] = ((None, 0.0), 0.0)
        self._streams: dict[str, int] = {}  # user -> SSE streams open in this process
        self._open = 0  # SSE streams open in this process, all users

    async def aclose(self) -> None:
        await self.hub.close()
        await self.aredis.aclose()
        self.store.r.close()

    def authenticate(self, token: str) -> UserPublic:
        """The token's user, from the cache while Redis's auth generation has not moved (one GET), else from
        Redis: a rotation, a disable or a quota change in any API process is seen by the next request here."""
        generation = self.store.auth_generation()  # read first: a change after it moves it again
        hit = self._cached(token, generation)
        if hit is not None:
            return hit
        user = self.store.authenticate(token)
        if len(self._users) > 10_000:
            self._users.clear()
        self._users[token] = (user, time.monotonic() + USER_CACHE_S, generation)
        return user

    def _cached(self, token: str, generation: int) -> UserPublic | None:
        """The token's user if cached, fresh, and read under this auth generation."""
        hit = self._users.get(token)
        return hit[0] if hit and hit[1] > time.monotonic() and hit[2] == generation else None

    async def still_valid(self, token: str) -> bool:
        """Whether ``token`` still signs in (for a long-lived stream): one async GET while nothing changed."""
        generation = int(await self.aredis.get(keys.auth_generation()) or 0)
        if self._cached(token, generation) is not None:
            return True
        try:
            await run_in_threadpool(self.authenticate, token)
        except Unauthorized:
            return False
        return True

    def count_stream(self, user: str, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Count ``stream`` as one of ``user``'s open SSE streams until it is gone; 429 past
        ``TLAB_MAX_STREAMS_PER_USER``, or past ``TLAB_MAX_STREAMS`` of everyone's in this process. Released once, by
        whichever comes first: the wrapper's ``finally`` (ended, or cancelled when the client went away — at once,
        not when the garbage collector gets to a cycle that holds it) or a finalizer (a stream never started)."""
        cap, total = self.settings.max_streams_per_user, self.settings.max_streams
        if self._streams.get(user, 0) >= cap:
            raise TooManyRequests(f"you have {cap} event streams open (TLAB_MAX_STREAMS_PER_USER): close one; a "
                                  "sweep's stream carries all its trials", field="events", retry_after_s=STREAM_RETRY_S)
        if self._open >= total:
            raise TooManyRequests(f"this API process has {total} event streams open, everyone's together "
                                  "(TLAB_MAX_STREAMS): try again shortly", field="events", retry_after_s=STREAM_RETRY_S)
        self._streams[user] = self._streams.get(user, 0) + 1
        self._open += 1
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                self._stream_closed(user)

        async def counted() -> AsyncIterator[Any]:
            try:
                async for item in stream:
                    yield item
            finally:
                release()

        wrapped = counted()
        weakref.finalize(wrapped, release)
        return wrapped

    def _stream_closed(self, user: str) -> None:
        self._open -= 1
        left = self._streams.get(user, 1) - 1
        if left > 0:
            self._streams[user] = left
        else:
            self._streams.pop(user, None)

    def cluster_view(self) -> tuple[ClusterView | None, float]:
        """The scheduler's last published view and its age in seconds (re-read at most every 0.5 s)."""
        now = time.monotonic()
        if now - self._cluster[1] > CLUSTER_CACHE_S:
            self._cluster = (read_cluster_view(self.store, self.settings.tick_s), now)
        return self._cluster[0]

    def ray_jobs(self) -> Any:
        if self._jobs_client is None:
            from service.launch.ray_cluster import RayJobs

            self._jobs_client = RayJobs(self.settings.ray_address, {})
        return self._jobs_client


def get_state(request: Request) -> State:
    return request.app.state.tlab


StateDep = Annotated[State, Depends(get_state)]
bearer = HTTPBearer(auto_error=False, description="a Teleport Lab token (`tlab up` writes the admin's)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def current_user(st: StateDep, creds: Credentials) -> UserPublic:
    return st.authenticate(creds.credentials if creds else "")


CurrentUser = Annotated[UserPublic, Depends(current_user)]


def stream_token(creds: Credentials,
                 token: Annotated[str | None, Query(max_length=200, description=(
                     "the token, for EventSource clients that cannot send headers; the Authorization header "
                     "wins"))] = None) -> str:
    """The bearer token, or ``?token=`` on the SSE routes (a browser's EventSource sends no headers)."""
    return creds.credentials if creds else token or ""


StreamToken = Annotated[str, Depends(stream_token)]


def stream_user(st: StateDep, token: StreamToken) -> UserPublic:
    return st.authenticate(token)


StreamUser = Annotated[UserPublic, Depends(stream_user)]


def admin_user(user: CurrentUser) -> UserPublic:
    if user.role != Role.ADMIN:
        raise Forbidden("only an admin may do this", field="Authorization")
    return user


AdminUser = Annotated[UserPublic, Depends(admin_user)]


def own_job(st: State, user: UserPublic, job_id: str) -> dict[str, str]:
    """The job's raw hash if ``user`` owns it (or is an admin); 404 if there is none (or the id is not one), 403
    if it is another's."""
    if not JOB_ID.fullmatch(job_id):  # before any Redis key is made of it: `<id>:trials` is another key's name
        raise JobNotFound(f"{job_id[:40]!r} is not an experiment id (like 18f3a2b4c5d-9e1f2a): `tlab ls` lists yours",
                          field="id")
    data = st.store.raw(job_id)
    if user.role != Role.ADMIN and data["owner"] != user.name:
        raise Forbidden(f"experiment {job_id} belongs to another user", field="id")
    return data


def own_sweep(st: State, user: UserPublic, sweep_id: str) -> dict[str, str]:
    """Like ``own_job``, and a 404 naming the experiment route when the id is not a sweep."""
    data = own_job(st, user, sweep_id)
    if data.get("kind") != "sweep":
        raise JobNotFound(f"{sweep_id} is an experiment, not a sweep: see /v1/experiments/{sweep_id}", field="id")
    return data


def job_filter(state: JobState | None = None, owner: str | None = None, tag: str | None = None) -> JobFilter:
    return JobFilter(state, owner, tag)


def page(cursor: Annotated[str | None, Query(max_length=64)] = None,
         limit: Annotated[int, Query(ge=1, le=500)] = 50) -> Page:
    return Page(cursor, limit)


JobFilterDep = Annotated[JobFilter, Depends(job_filter)]
PageDep = Annotated[Page, Depends(page)]
