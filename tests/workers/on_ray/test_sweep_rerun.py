"""A rerun's driver resumes the marked errored trials only: Tune's experiment state rewritten before ``Tuner.restore``
(``workers.on_ray.sweep_rerun``), read back as Tune reads it. The whole rerun on Ray: tests/service/test_sweeps.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.job.harness import SetupError
from workers.on_ray.sweep_rerun import resume_only


def write_state(path: Path, statuses: dict[str, str]) -> Path:
    """An experiment state as Tune's TuneController.save_to_dir writes it (the fields read here)."""
    data = [[json.dumps({"trial_id": t, "status": s, "config": {"x": 1}}, indent=2), json.dumps({"n": 1})]
            for t, s in statuses.items()]
    state = path / "experiment_state-2026-11-25_13-00-00.json"
    state.write_text(json.dumps({"trial_data": data, "runner_data": {"_x": 1}, "stats": {"start_time": 1.0}}))
    (path / "experiment_state-2026-11-25_12-00-00.json").write_text("{}")  # older: left alone
    return state


def test_marked_errored_trials_resume_other_errors_stay(tmp_path: Path) -> None:
    state = write_state(tmp_path, {"a": "ERROR", "b": "ERROR", "c": "RUNNING", "d": "PENDING", "e": "TERMINATED",
                                   "f": "TERMINATED"})
    resumed = resume_only(str(tmp_path), rerun={"a", "c", "f"})
    assert resumed == ["a", "c"]  # f already finished (in an earlier start of this rerun): not run again
    data = json.loads(state.read_text())
    after = {json.loads(t)["trial_id"]: json.loads(t)["status"] for t, _ in data["trial_data"]}
    # a: unfinished now, so Tune resumes it; b stays errored (skipped); c, d resume as unfinished trials do
    assert after == {"a": "PENDING", "b": "ERROR", "c": "RUNNING", "d": "PENDING", "e": "TERMINATED",
                     "f": "TERMINATED"}
    assert data["runner_data"] == {"_x": 1} and json.loads(data["trial_data"][0][0])["config"] == {"x": 1}
    assert not list(tmp_path.glob("*.tmp"))


def test_no_state_to_resume_from_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match=r"rerun: no Tune experiment state in .*submit the sweep again"):
        resume_only(str(tmp_path), rerun={"a"})


def test_the_marks_are_read_from_the_trials_table(redis_server: str) -> None:
    import redis

    from api_schemas import keys
    from workers.on_ray.sweep_rerun import marked_trials

    r = redis.Redis.from_url(redis_server, decode_responses=True)
    rows = {"a": {"state": "queued", "rerun": True}, "b": {"state": "failed"}, "c": {"state": "cancelled"},
            "d": {"state": "running"}, "e": {"state": "succeeded", "rerun": False},
            "f": {"state": "failed", "rerun": True}}
    r.hset(keys.trials("s-rerun"), mapping={t: json.dumps({"trial": t, **row}) for t, row in rows.items()})
    assert marked_trials(r, "s-rerun") == {"a", "f"}
