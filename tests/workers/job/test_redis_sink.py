"""The Redis metric sink on a real redis-server: ordered, batched, exactly-once per epoch."""

from __future__ import annotations

from pathlib import Path

from workers.job.redis_sink import RedisSink, read_events


def test_events_arrive_in_order_and_reemitted_epochs_are_not_duplicated(redis_server: str) -> None:
    sink = RedisSink(redis_server, "job1", batch_size=4, flush_seconds=60)
    sink.emit({"kind": "start", "spec": {}})
    for b in range(3):
        sink.emit({"kind": "teleport", "epoch": 0, "batch": b, "loss_before": 1.0})
    for e in range(3):
        sink.emit({"kind": "epoch", "epoch": e, "train_loss": 1.0 / (e + 1)})
    sink.close()
    # a worker restarted from the epoch-1 checkpoint redoes epoch 2 and goes on
    again = RedisSink(redis_server, "job1")
    again.emit({"kind": "epoch", "epoch": 2, "train_loss": 0.0})
    again.emit({"kind": "epoch", "epoch": 3, "train_loss": 0.25})
    again.close()
    events = read_events(redis_server, "job1")
    assert [e["kind"] for e in events] == ["status"] + ["teleport"] * 3 + ["metric"] * 4
    epochs = [e["data"]["epoch"] for e in events if e["kind"] == "metric"]
    assert epochs == [0, 1, 2, 3]
    assert events[6]["data"]["train_loss"] == 1.0 / 3  # the first report of epoch 2 stands
    ids = [e["id"] for e in events]
    assert ids == sorted(ids, key=lambda i: tuple(int(p) for p in i.split("-")))


def test_buffer_flushes_by_size(redis_server: str) -> None:
    sink = RedisSink(redis_server, "job2", batch_size=2, flush_seconds=60)
    sink.emit({"kind": "teleport", "epoch": 0, "batch": 0})
    assert read_events(redis_server, "job2") == []
    sink.emit({"kind": "teleport", "epoch": 0, "batch": 1})
    assert len(read_events(redis_server, "job2")) == 2
    sink.emit({"kind": "teleport", "epoch": 0, "batch": 2})
    sink.emit({"kind": "start"})  # at once: its stream time is when the loop was set up (benchmarks' timeline)
    assert [e["kind"] for e in read_events(redis_server, "job2")] == ["teleport"] * 3 + ["status"]
    sink.close()


def test_jsonl_sink_writes_each_epoch_once_across_a_resume(tmp_path: Path) -> None:
    import json

    from workers.train.sinks import JsonlSink

    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    for e in range(3):
        first.emit({"kind": "epoch", "epoch": e, "train_loss": 1.0})
    first.close()
    resumed = JsonlSink(path)  # restarted from the epoch-1 checkpoint: redoes epoch 2
    resumed.emit({"kind": "start"})
    resumed.emit({"kind": "epoch", "epoch": 2, "train_loss": 0.5})
    resumed.emit({"kind": "epoch", "epoch": 3, "train_loss": 0.4})
    resumed.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r.get("epoch") for r in lines if r["kind"] == "epoch"] == [0, 1, 2, 3]
    assert sum(r["kind"] == "start" for r in lines) == 1
