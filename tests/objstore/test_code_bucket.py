"""Users' code packages with a bucket as storage: the API host that stores a package uploads it, and another host
(an API after a restart elsewhere, or the scheduler) that lacks it downloads it when it checks a submit, finds the
package, or starts the job (real Redis, moto's S3 server)."""

from __future__ import annotations

from pathlib import Path

import redis

from api_schemas import keys
from api_schemas.jobs import Quotas, Role, UserPublic
from api_schemas.spec import ExperimentSpec
from service.core.code_store import JobCode, check_code, find_package, store_package
from service.core.settings import Settings
from service.core.zip_modes import masked
from tests.service.api.test_code_upload import custom_spec, zip_of

JOB = "18f3a2b4c5d-0000c0"


def test_a_package_stored_on_one_host_is_found_and_started_on_another(redis_server: str, s3_uri: str,
                                                                      tmp_path: Path) -> None:
    api = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "api"))
    other = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "other"))
    data = zip_of({"tiny_lm/__init__.py": b""})
    package, new = store_package(api, "ann", data)
    assert new
    ann = UserPublic(name="ann", role=Role.USER, can_submit_code=True, quotas=Quotas(), created_at=0.0)
    spec = ExperimentSpec.model_validate(custom_spec(package.package))
    check_code(other, ann, spec, "spec")  # found in the bucket: no 422
    assert find_package(other, ann, package.package).bytes == len(data)
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    r.hset(keys.job(JOB), mapping={"owner": "ann", "spec": spec.model_dump_json()})
    third = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "scheduler"))
    env = JobCode(third, r)(JOB)  # the scheduler's host never saw it: it downloads it to hand Ray
    assert Path(env["working_dir"]).read_bytes() == masked(data)  # Ray gets the copy with members' modes masked


def test_a_package_in_neither_place_is_not_found(s3_uri: str, tmp_path: Path) -> None:
    import pytest

    from service.core.code_store import PackageNotFound

    s = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "api"))
    ann = UserPublic(name="ann", role=Role.USER, can_submit_code=True, quotas=Quotas(), created_at=0.0)
    with pytest.raises(PackageNotFound):
        find_package(s, ann, "sha256:" + "0" * 64)


def test_an_expired_package_leaves_the_bucket_too(redis_server: str, s3_uri: str, tmp_path: Path) -> None:
    """TLAB_CODE_TTL_DAYS with a bucket: the package no job refers to goes from the bucket as well, so no other
    host downloads it again."""
    import os
    import time

    import pytest

    from service.core import retention
    from service.core.code_store import PackageNotFound, package_path
    from service.core.store import Store

    api = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "api"), REDIS_URL=redis_server,
                   TLAB_CODE_TTL_DAYS="1")
    other = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "other"))
    package, _ = store_package(api, "bea", zip_of({"idle/__init__.py": b"# nobody runs this\n"}))
    path = package_path(api, "bea", package.package)
    old = time.time() - 2 * 86400.0
    os.utime(path, (old, old))
    assert retention.expire_code(Store.from_url(redis_server), api, time.time()) == [
        path.relative_to(api.storage_path).as_posix()]
    bea = UserPublic(name="bea", role=Role.USER, can_submit_code=True, quotas=Quotas(), created_at=0.0)
    with pytest.raises(PackageNotFound):
        find_package(other, bea, package.package)
