"""What the scheduler hands every Ray job in its environment: the service's limits, read where the job runs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.core.settings import Settings
from service.launch.job_env import job_env
from workers.train.context import checkpoint_every_s, keep_checkpoints


def test_a_jobs_checkpoint_settings_come_from_the_service_and_parse_in_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TLAB_CHECKPOINT_EVERY_S", raising=False)
    assert job_env(Settings())["TLAB_CHECKPOINT_EVERY_S"] == "2.0"  # the default
    env = job_env(Settings(TLAB_CHECKPOINT_EVERY_S="0.5", TLAB_KEEP_CHECKPOINTS="3"))
    assert (env["TLAB_CHECKPOINT_EVERY_S"], env["TLAB_KEEP_CHECKPOINTS"]) == ("0.5", "3")
    for name in ("TLAB_CHECKPOINT_EVERY_S", "TLAB_KEEP_CHECKPOINTS"):
        monkeypatch.setenv(name, env[name])  # as the job's driver sees them
    assert (checkpoint_every_s(), keep_checkpoints()) == (0.5, 3)


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "often"])
def test_a_bad_checkpoint_interval_stops_the_service_at_start_naming_it(raw: str) -> None:
    with pytest.raises(ValidationError, match="TLAB_CHECKPOINT_EVERY_S"):
        Settings(TLAB_CHECKPOINT_EVERY_S=raw)
