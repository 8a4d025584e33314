"""``POST /v1/code`` and ``spec.code`` on the real API (no Ray): content-addressed uploads, owner-only packages, bad
zips refused with the reason, and at submit: an unknown or another user's package, factories' syntax, user code
turned off."""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from pathlib import Path

import pytest

from api_schemas import ExperimentSpec
from service.cli.code_zip import zip_dir
from service.core.code_store import check_zip, package_path, runtime_env_for
from service.core.errors import InvalidInput
from service.core.settings import Settings
from tests.service.conftest import Api, tiny

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny_lm"
ZIP = {"Content-Type": "application/zip"}


@pytest.fixture()
def api_env() -> dict[str, str]:
    return {"TLAB_MAX_CODE_MB": "0.25", "TLAB_MAX_CODE_UNPACKED_MB": "1", "TLAB_CODE_MAX_FILES": "100"}


def zip_of(members: dict[str, bytes], symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = 0o120777 << 16
            z.writestr(info, "/etc/passwd")
    return buf.getvalue()


def custom_spec(package: str | None = None) -> dict:
    spec = tiny(teleport={"enabled": False})
    spec["model"] = {"kind": "custom", "factory": "tiny_lm.model:gpt", "args": {"d": 16}}
    spec["dataset"] = {"name": "custom", "factory": "tiny_lm.data:python_source"}
    if package:
        spec["code"] = {"package": package}
    return spec


def test_upload_is_content_addressed_and_visible_to_its_owner_and_admins(api_only: Api) -> None:
    data = zip_dir(EXAMPLE, 1 << 20)
    expected = f"sha256:{hashlib.sha256(data).hexdigest()}"
    for name in ("alice", "bob", "carol"):
        api_only.add_user(name)
    with api_only.client() as admin:
        for name in ("alice", "bob"):
            assert admin.patch(f"/v1/users/{name}", json={"can_submit_code": True}).status_code == 200
    with api_only.client("carol") as carol:  # not allowed to run code: refused before any byte is kept
        r = carol.post("/v1/code", content=data, headers=ZIP)
        assert r.status_code == 403 and r.json()["errors"][0]["field"] == "code" and "can-submit-code" in r.text
    with api_only.client("alice") as alice, api_only.client("bob") as bob, api_only.client() as admin:
        first = alice.post("/v1/code", content=data, headers=ZIP)
        assert first.status_code == 201, first.text
        assert first.json()["package"] == expected and first.json()["bytes"] == len(data)
        again = alice.post("/v1/code", content=data, headers=ZIP)
        assert again.status_code == 200 and again.json()["package"] == expected
        stored = list((api_only.stack.home / "storage" / "code" / "alice").iterdir())
        assert [p.name for p in stored] == [f"{expected[7:]}.zip"]  # once, under its owner
        assert alice.get(f"/v1/code/{expected}").json()["owner"] == "alice"
        assert admin.get(f"/v1/code/{expected}").json()["files"] >= 4
        assert bob.get(f"/v1/code/{expected}").status_code == 404  # another user's: not even its existence
        assert alice.post("/v1/experiments", json={"spec": custom_spec(expected)}).status_code == 201
        refused = bob.post("/v1/experiments", json={"spec": custom_spec(expected)})
        assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "spec.code.package"
    # what the scheduler hands Ray for alice's job: a verified copy of the stored zip, outside the storage jobs
    # write, as working_dir, the requirements as pip
    spec = ExperimentSpec.model_validate({**custom_spec(expected), "code": {"package": expected,
                                                                           "requirements": ["einops==0.8.0"]}})
    env = runtime_env_for(Settings(TLAB_HOME=str(api_only.stack.home)), "alice", spec)
    copy = api_only.stack.home / "packages" / f"{expected.removeprefix('sha256:')}.zip"
    assert env == {"working_dir": str(copy), "pip": ["einops==0.8.0"]} and copy.read_bytes() == data


@pytest.mark.parametrize(("body", "status", "needle"), [
    (zip_of({"../evil.py": b"x"}), 422, "'..'"),
    (zip_of({"/abs.py": b"x"}), 422, "absolute name"),
    (zip_of({"a.py": b"x"}, symlink="link.py"), 422, "symbolic link"),
    (b"this is not a zip", 422, "not a zip archive"),
    (zip_of({"zeros.bin": bytes(2 << 20)}), 422, "TLAB_MAX_CODE_UNPACKED_MB"),  # a bomb: 2 MiB from ~2 KiB
    (bytes(300_000), 413, "TLAB_MAX_CODE_MB"),
], ids=["dotdot", "absolute", "symlink", "not_zip", "unpacked_cap", "over_cap"])
def test_bad_packages_are_refused_with_the_reason(api_only: Api, body: bytes, status: int, needle: str) -> None:
    with api_only.client() as c:
        r = c.post("/v1/code", content=body, headers=ZIP)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"] and r.json()["errors"][0]["field"] == "body"


def test_submit_checks_the_code_fields(api_only: Api) -> None:
    with api_only.client() as c:
        unknown = c.post("/v1/experiments", json={"spec": custom_spec("sha256:" + "0" * 64)})
        assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "spec.code.package"
        bad = custom_spec()
        bad["model"]["factory"] = "tiny_lm.model"
        r = c.post("/v1/experiments", json={"spec": bad})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "spec.model.factory"
        assert "package.module:function" in r.json()["detail"]
        for requirement in ("x @ https://example.org/x.whl", "requests --index-url http://mirror", "-e ."):
            spec = {**custom_spec(), "code": {"requirements": ["einops==0.8.0", requirement]}}
            r = c.post("/v1/experiments", json={"spec": spec})
            assert r.status_code == 422 and r.json()["errors"][0]["field"] == "spec.code.requirements.1", r.text
        sweep = {"base": custom_spec(), "search_space": {"model.args.heads": {"grid": [1, 2]}}}
        assert c.post("/v1/sweeps", json=sweep).status_code == 201  # a factory's argument is a sweep axis
        assert c.post("/v1/code", content=b"PK", headers={"Content-Type": "text/plain"}).status_code == 415


@pytest.mark.parametrize("api_env", [{"TLAB_USER_CODE": "off"}])
def test_user_code_can_be_turned_off(api_only: Api) -> None:
    with api_only.client() as c:
        r = c.post("/v1/experiments", json={"spec": custom_spec()})
        assert r.status_code == 403 and r.json()["errors"][0]["field"] == "spec.code"
        assert "TLAB_USER_CODE=off" in r.json()["detail"] and "model.factory" in r.json()["detail"]
        assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 201  # built-ins run as before
        upload = c.post("/v1/code", content=zip_of({"a.py": b"x"}), headers=ZIP)
        assert upload.status_code == 403 and upload.json()["errors"][0]["field"] == "code"
        for path, status in (("training.entrypoint", 403), ("training.loss", 403), ("code.package", 422)):
            axis = {path: {"choice": ["os:system" if path != "code.package" else "sha256:" + "0" * 64]}}
            base = {**tiny(), "code": {}}  # an empty code section runs no code, and makes code.* a spec path
            r = c.post("/v1/sweeps", json={"base": base, "search_space": axis})  # code through a sweep's axis
            assert r.status_code == status and r.json()["errors"][0]["field"] == f"search_space.{path}", r.text


def test_tlab_submit_code_uploads_once_and_submits_with_the_package(api_only: Api, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    repo = str(EXAMPLE.parents[1])  # this checkout's CLI, whatever the installed `tlab` points at
    tlab = [sys.executable, "-m", "service.cli", "--url", api_only.url, "--token", api_only.tokens["admin"]]
    spec = str(EXAMPLE / "spec.yaml")
    runs = [subprocess.run([*tlab, "submit", spec, "--code", str(EXAMPLE)], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": repo}) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    assert "KiB, uploaded)" in runs[0].stderr and "unchanged, not uploaded again" in runs[1].stderr
    data = zip_dir(EXAMPLE, 1 << 20)
    package = f"sha256:{hashlib.sha256(data).hexdigest()}"
    kept = package_path(Settings(TLAB_HOME=str(api_only.stack.home)), "admin", package)
    kept.write_bytes(data + b"\0")  # a job wrote over it in storage: uploaded again
    again = subprocess.run([*tlab, "submit", spec, "--code", str(EXAMPLE)], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": repo})
    assert again.returncode == 0 and "KiB, uploaded)" in again.stderr, again.stderr
    assert kept.read_bytes() == data
    with api_only.client() as c:
        job = c.get(f"/v1/experiments/{runs[1].stdout.split()[0]}").json()
    assert job["spec"]["code"]["package"] == package and job["spec"]["model"]["kind"] == "custom"


def test_a_job_whose_package_is_gone_fails_at_once_and_a_refused_submit_costs_no_attempt(api_only: Api) -> None:
    """The scheduler's start of two queued jobs, on Redis, with a Ray that is never reached: the one whose stored
    package was deleted fails with one line (it was retried every tick before); the other, which Ray "refused",
    goes back to the queue with its attempt not counted."""
    from api_schemas.jobs import JobState
    from service.core.code_store import JobCode
    from service.core.store import Store
    from service.launch.ray_cluster import RayJobs, StaticCluster
    from service.scheduler.tick import Scheduler
    from tests.service.conftest import STATIC_NODES

    with api_only.client() as c:
        package = c.post("/v1/code", content=zip_of({"tiny_lm/__init__.py": b""}), headers=ZIP).json()["package"]
        gone = c.post("/v1/experiments", json={"spec": custom_spec(package)}).json()["id"]
        builtin = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    settings = Settings(redis_url=api_only.stack.redis_url or "", cluster_nodes=STATIC_NODES,
                        home=api_only.stack.home)
    store = Store.from_url(settings.redis_url)
    package_path(settings, "admin", package).unlink()
    jobs = RayJobs.__new__(RayJobs)  # every field but the Jobs API client: nothing here reaches Ray
    jobs.env, jobs.python, jobs.credentials, jobs.client = {}, "python", None, None
    jobs.code = JobCode(settings, store.r)
    Scheduler(store, settings, StaticCluster(STATIC_NODES), jobs).dispatch(time.time())
    failed = store.view(gone)
    assert failed.state == JobState.FAILED, failed
    assert failed.failure_reason and "no longer stored" in failed.failure_reason and "\n" not in failed.failure_reason
    again = store.raw(builtin)
    assert again["state"] == JobState.QUEUED.value and again["attempts"] == "0", again


def tamper(path: Path, how: str) -> None:
    """What a job that can write the storage does to a stored package: rewrite it, or make it a link."""
    if how == "rewritten":
        path.write_bytes(zip_of({"tiny_lm/__init__.py": b"import os; os.system('id')"}))
    else:
        path.unlink()
        path.symlink_to("/proc/self/environ")


@pytest.mark.parametrize("how", ["rewritten", "linked"])
def test_a_tampered_package_is_refused_at_submit_and_at_start_and_replaced_by_an_upload(api_only: Api,
                                                                                          how: str) -> None:
    """A stored package that no longer hashes to its name (or is a link now) refuses a submit naming it, makes a
    queued job with it fail at its start (the scheduler's dispatch, on Redis; no Ray reached), answers 404 to the
    CLI's ``GET /v1/code/{id}``; the same upload writes it again."""
    from api_schemas.jobs import JobState
    from service.core.code_store import JobCode
    from service.core.store import Store
    from service.launch.ray_cluster import RayJobs, StaticCluster
    from service.scheduler.tick import Scheduler
    from tests.service.conftest import STATIC_NODES

    data = zip_of({"tiny_lm/__init__.py": b""})
    settings = Settings(redis_url=api_only.stack.redis_url or "", cluster_nodes=STATIC_NODES,
                        home=api_only.stack.home)
    with api_only.client() as c:
        package = c.post("/v1/code", content=data, headers=ZIP).json()["package"]
        queued = c.post("/v1/experiments", json={"spec": custom_spec(package)}).json()["id"]
        tamper(package_path(settings, "admin", package), how)
        r = c.post("/v1/experiments", json={"spec": custom_spec(package)})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "spec.code.package", r.text
        assert package in r.text and "upload it again" in r.text and "\n" not in r.json()["errors"][0]["message"]
        assert c.get(f"/v1/code/{package}").status_code == 404  # so `tlab submit --code` uploads it again
        store = Store.from_url(settings.redis_url)
        jobs = RayJobs.__new__(RayJobs)  # every field but the Jobs API client: nothing here reaches Ray
        jobs.env, jobs.python, jobs.credentials, jobs.client = {}, "python", None, None
        jobs.code = JobCode(settings, store.r)
        Scheduler(store, settings, StaticCluster(STATIC_NODES), jobs).dispatch(time.time())
        failed = store.view(queued)
        assert failed.state == JobState.FAILED and package in (failed.failure_reason or ""), failed
        assert not (api_only.stack.home / "packages" / f"{package.removeprefix('sha256:')}.zip").exists()
        assert c.post("/v1/code", content=data, headers=ZIP).status_code in (200, 201)
        assert package_path(settings, "admin", package).read_bytes() == data
        assert not package_path(settings, "admin", package).is_symlink()
        assert c.post("/v1/experiments", json={"spec": custom_spec(package)}).status_code == 201


def test_a_package_of_too_many_files_is_refused_at_upload(api_only: Api) -> None:
    with api_only.client() as c:  # this module's cap: 100 members
        r = c.post("/v1/code", content=zip_of({f"pkg/f{i}.py": b"" for i in range(101)}), headers=ZIP)
        assert r.status_code == 422 and "101 members, more than 100 (TLAB_CODE_MAX_FILES)" in r.text, r.text
        assert c.post("/v1/code", content=zip_of({f"pkg/f{i}.py": b"" for i in range(100)}), headers=ZIP).is_success
    many = zip_of({f"f{i}": b"" for i in range(100_001)})  # the review's 100,001 files: ~10 MB, under the size caps
    with pytest.raises(InvalidInput, match="100001 members, more than 10000 .TLAB_CODE_MAX_FILES."):
        check_zip(many, 200 << 20, Settings().code_max_files)


def test_members_unpack_for_ray_with_modes_masked(api_only: Api, tmp_path: Path) -> None:
    """A member marked setuid (04755) or writable by all (0666) unpacks, through Ray's own unzip of the copy the
    scheduler hands it, as 0755 and 0644."""
    from ray._private.runtime_env.packaging import unzip_package

    modes = {"pkg/suid.sh": 0o104755, "pkg/open.py": 0o100666, "pkg/run.sh": 0o100700, "pkg/dir/": 0o40777}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, mode in modes.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            z.writestr(info, b"" if name.endswith("/") else b"x")
    with api_only.client() as c:
        package = c.post("/v1/code", content=buf.getvalue(), headers=ZIP).json()["package"]
    spec = ExperimentSpec.model_validate(custom_spec(package))
    given = runtime_env_for(Settings(TLAB_HOME=str(api_only.stack.home)), "admin", spec)["working_dir"]
    unzip_package(given, str(tmp_path / "out"), remove_top_level_directory=False, unlink_zip=False)
    got = {name: oct((tmp_path / "out" / name).stat().st_mode & 0o7777) for name in modes}
    assert got == {"pkg/suid.sh": "0o755", "pkg/open.py": "0o644", "pkg/run.sh": "0o755", "pkg/dir/": "0o755"}
