"""Where a run's records go: ``emit(record)`` then ``close()``.

The training loop writes plain dicts (``{"kind": "epoch", ...}``, ``{"kind": "teleport", ...}``);
a sink decides where they land: ``DIR/metrics.jsonl`` for a local run, the job's Redis stream
(``workers.job.redis_sink.RedisSink``) on the cluster, a list in memory for tests and ``compare``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricSink(Protocol):
    def emit(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Drops every record (ranks other than 0)."""

    def emit(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class SaySink:
    """Prints the run's messages to a person (the budget's cuts, a setting that leaves teleport idle) on stderr:
    a local run's console shows them as the job page and ``tlab demo`` do."""

    KINDS = ("budget", "hint")

    def emit(self, record: dict[str, Any]) -> None:
        if record.get("kind") in self.KINDS and record.get("message"):
            print(f"{record['kind']}: {record['message']}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class MemorySink:
    """Keeps the records in ``records``."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def identity(record: dict[str, Any]) -> str:
    """What makes a record unique within a run ('' = not deduplicated): a worker restarted from a
    checkpoint redoes epochs, and each epoch and teleport batch must still be recorded once."""
    if record.get("kind") == "epoch":
        return f"epoch:{record['epoch']}"
    if record.get("kind") == "teleport":
        return f"teleport:{record['epoch']}:{record['batch']}"
    return ""


class JsonlSink:
    """Appends one JSON line per record to ``path`` and flushes it, so a crash loses nothing written.

    Epoch and teleport records already in the file (a resumed run redoing them) are not written again.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._seen: set[str] = set()
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    self._seen.add(identity(json.loads(line)))
        self._file = self.path.open("a", encoding="utf-8")

    def emit(self, record: dict[str, Any]) -> None:
        key = identity(record)
        if key and key in self._seen:
            return
        self._seen.add(key)
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TeeSink:
    """Sends every record to each of ``sinks`` in order."""

    def __init__(self, *sinks: MetricSink) -> None:
        self.sinks = sinks

    def emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.emit(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
