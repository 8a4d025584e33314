"""Following a job's log over SSE from an API host that is not the job's, with a bucket as storage: the follow
pulls what the job's host uploaded as it goes, and once more when the job has ended, so the last lines arrive
before ``end`` (moto's S3 server; the follow as the route runs it, without HTTP)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from service.api import job_logs
from service.core import storage
from service.core.settings import Settings

JOB = "18f3a2b4c5d-0000d0"


def test_a_follow_on_another_host_pulls_the_log_as_it_grows(s3_uri: str, tmp_path: Path) -> None:
    api = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "api"))
    bucket = storage.bucket(api)
    node = tmp_path / "node" / JOB
    log = node / "logs" / "attempt-1" / "driver.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"first line\n")
    bucket.push(node, JOB)
    state = {"ended": False}

    async def ended() -> bool:
        return state["ended"]

    async def valid() -> bool:
        return True

    async def run() -> list[str]:
        seen = []
        stream = job_logs.follow(api.storage_path, JOB, "driver", None, ended, valid, 30.0,
                                 lambda: storage.sync_logs(api, JOB))
        async for event in stream:
            seen.append(event)
            if "first line" in event:  # the job writes its last line, uploads it and ends
                with log.open("ab") as f:
                    f.write(b"last line\n")
                await asyncio.to_thread(bucket.push, node, JOB)
                state["ended"] = True
        return seen

    events = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert "data: first line" in events[1] and "data: last line" in events[2], events
    assert events[-1].startswith("event: end")
