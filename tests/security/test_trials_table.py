"""Red team: a sweep's trials table (``keys.trials``), which the sweep's own code can write, read by the trusted side.

A trial forges rows: a ``trial`` of ``/../../<victim id>``, a row under another row's name, rows that are no JSON
object. A rerun's driver (``workers.on_ray.sweep_rerun.marked_trials``) takes only ids of Tune's shape that are their
own row's name, and says in the job's log which rows it left out. The API's view of the sweep
(``service.api.studies``) shows the forged rows as they are, for that sweep only: it reads no key but the sweep's own
table (a Redis user allowed nothing else) and no file. Real Redis, no Ray."""

from __future__ import annotations

import builtins
import json
import os
from typing import Any

import pytest
import redis

from api_schemas import keys
from api_schemas.sweeps import SweepSubmit
from service.api.studies import best_trial, study_view, trial_rows
from service.core.store import Store
from service.launch.job_acl import job_url
from tests.service.conftest import tiny
from workers.on_ray.sweep_rerun import marked_trials

SWEEP, VICTIM = "18f3a2b4c5d-000010", "18f3a2b4c5d-000011"
HONEST = "ab12c_00001"
FORGED = f"/../../{VICTIM}"


def row(trial: Any, best: float | None = 0.5, rerun: bool = True) -> str:
    return json.dumps({"trial": trial, "config": {"teleport.lr": 0.1}, "state": "failed", "epochs": 1, "best": best,
                       "rerun": rerun})


def test_a_rerun_takes_only_trial_ids_of_tunes_shape_from_the_table(redis_server: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    r.hset(keys.trials(SWEEP), mapping={
        HONEST: row(HONEST),
        "ab12c_00002": row(FORGED),  # a path where the id goes
        FORGED: row(FORGED),  # its row named the same
        "ab12c_00003": row("ab12c_00004"),  # another row's id
        "ab12c_00005": row(5),  # no string
        "ab12c_00006": "not json",
        "ab12c_00007": json.dumps([FORGED]),
        "ab12c_00008": row(FORGED, rerun=False),  # not marked: not read further
    })
    assert marked_trials(r, SWEEP) == {HONEST}
    said = [line for line in capsys.readouterr().err.splitlines() if "trials row left out" in line]
    assert len(said) == 5, said  # each marked row left out, in one line (the list and the unmarked row: not marked)
    r.close()


def reader(redis_server: str) -> redis.Redis:
    """A Redis user that may read the sweep's own trials table and nothing else."""
    admin = redis.Redis.from_url(redis_server)
    own = f"~{keys.glob_escape(keys.trials(SWEEP))}"
    admin.execute_command("ACL", "SETUSER", "studies", "reset", "on", ">studies", own, "-@all", "+hgetall", "+ping")
    admin.close()
    return redis.Redis.from_url(job_url(redis_server, "studies", "studies"), decode_responses=True)


def test_a_forged_row_shows_in_its_own_sweeps_view_only(redis_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import plots.tables  # noqa: F401 (the study table's module, loaded before files are closed off below)

    admin = redis.Redis.from_url(redis_server, decode_responses=True)
    admin.hset(keys.trials(VICTIM), mapping={"vv111_00001": row("vv111_00001", best=0.9)})
    admin.hset(keys.trials(SWEEP), mapping={HONEST: row(HONEST, best=0.5), "ab12c_00002": row(FORGED, best=0.0)})
    sweep = SweepSubmit.model_validate({"base": tiny(), "search_space": {"teleport.lr": {"choice": [0.1, 0.2]}}})

    def no_file(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the view opened a file: {args[:1]}")

    with monkeypatch.context() as m:
        for module, name in ((builtins, "open"), (os, "open"), (os, "stat"), (os, "listdir"), (os, "scandir")):
            m.setattr(module, name, no_file)
        rows = trial_rows(Store(reader(redis_server)), SWEEP)  # any other key read: NOPERM
        best = best_trial(rows, "min")
        study = study_view(SWEEP, sweep, rows)
    assert best is not None and best.trial == FORGED  # the sweep's own display, as its trial wrote it
    assert sorted(t for g in study.groups for t in g.trials) == sorted([HONEST, FORGED])
    victims = trial_rows(Store(admin), VICTIM)  # the victim's table as it was
    assert [(t.trial, t.best) for t in victims] == [("vv111_00001", 0.9)]
    admin.close()
