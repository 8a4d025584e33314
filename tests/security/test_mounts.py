"""Mounts come from an allow-list: a dataset's root or path is mounted into a job's sandbox only from under the data
roots (``TLAB_DATA_ROOTS``), never a directory holding the service's home or its storage, nor one inside storage
(another job's files), for every dataset kind, dry runs included; checked at submit (422 naming the field) and again
by the supervisor before it mounts (a spec that reached Redis some other way), which also never mounts the node's
working directory as the job's code when that is ``/``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_schemas.spec import ExperimentSpec
from service.cli.client import Client
from service.cli.code_zip import upload
from service.core.settings import Settings
from tests.service.conftest import Api, tiny
from workers.job import sandbox
from workers.on_ray import supervisor

KINDS = {"digits": "root", "synthetic": "root", "mnist": "root", "cifar10": "root", "npz": "path", "custom": "root"}


def targets(home: Path, other_job: str) -> dict[str, str]:
    storage = Path(Settings(TLAB_HOME=home).storage_path)
    return {"the service's home": str(home), "the storage root": str(storage),
            "another job's directory": str(storage / other_job), "/": "/"}


def dataset(kind: str, field: str, value: str) -> dict:
    ds: dict = {"name": kind, field: value}
    if kind == "custom":
        ds["factory"] = "data:make"
    return ds


def refused_everywhere(api: Api, tmp_path: Path) -> None:
    storage = Path(Settings(TLAB_HOME=api.stack.home).storage_path)
    (storage / "victim-job" / "artifacts").mkdir(parents=True, exist_ok=True)
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "data.py").write_text("def make(root=None):\n    raise SystemExit\n")
    with api.client() as http, Client(api.stack.url, api.stack.admin_token) as c:
        package = upload(c, str(pkg))["package"]
        for kind, field in KINDS.items():
            for what, value in targets(api.stack.home, "victim-job").items():
                spec = {**tiny(), "dataset": dataset(kind, field, value)}
                if kind == "custom":
                    spec["code"] = {"package": package}
                for dry in ("false", "true"):
                    r = http.post(f"/v1/experiments?dry_run={dry}", json={"spec": spec})
                    assert r.status_code == 422, (kind, what, dry, r.status_code, r.text)
                    assert r.json()["errors"][0]["field"] == f"spec.dataset.{field}", (kind, what, r.json())
                r = http.post("/v1/sweeps", json={"base": spec, "search_space": {"optimizer.lr": {"grid": [0.1]}}})
                assert r.status_code == 422, (kind, what, r.text)
                assert r.json()["errors"][0]["field"] == f"base.dataset.{field}", (kind, what, r.text)


def test_a_dataset_at_the_services_own_files_is_refused_at_submit_for_every_kind(api_only: Api,
                                                                                  tmp_path: Path) -> None:
    """Under the default data roots (``$TLAB_HOME/data``): each target is outside them."""
    refused_everywhere(api_only, tmp_path)


@pytest.fixture()
def api_env(tmp_path: Path) -> dict[str, str]:
    """An admin's data root that holds the service's home and storage (a careless ``/`` or ``/srv``)."""
    return {"TLAB_DATA_ROOTS": str(tmp_path)}


def test_a_data_root_that_holds_the_service_still_never_mounts_it(api_only: Api, tmp_path: Path) -> None:
    refused_everywhere(api_only, tmp_path)


@pytest.fixture()
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A supervisor's environment as ``service.launch.job_env`` gives it: data roots, the directories to hide."""
    home, data = tmp_path / "home", tmp_path / "data"
    (home / "storage" / "job-a").mkdir(parents=True)
    (data / "mnist").mkdir(parents=True)
    monkeypatch.setenv(sandbox.HIDE, f"{home}:{home / 'storage'}")
    monkeypatch.setenv(sandbox.ROOTS, str(data))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield home


@pytest.mark.parametrize("field", ["root", "path"])
def test_the_supervisor_checks_a_specs_data_again_before_it_mounts(node: Path, field: str) -> None:
    """A spec that never passed the API (written into Redis by hand): refused with one line naming the field."""
    job_dir = node / "storage" / "job-a"
    fine = ExperimentSpec.model_validate({**tiny(), "dataset": {"name": "mnist", "root": str(node.parent / "data"
                                                                                              / "mnist")}})
    assert Path(node.parent / "data" / "mnist") in supervisor.mounts(fine, job_dir, None).readable
    for bad in (node, node / "storage", node / "storage" / "job-a", Path("/"), node.parent / "elsewhere"):
        spec = ExperimentSpec.model_validate({**tiny(), "dataset": {"name": "custom", "factory": "data:make",
                                                                    field: str(bad)}})
        with pytest.raises(sandbox.MountRefused, match=f"dataset.{field} {bad} "):
            supervisor.mounts(spec, job_dir, None)


def test_the_nodes_working_directory_is_never_the_jobs_code_when_it_is_root(node: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray node started from ``/`` (no ``working_dir`` on ``PYTHONPATH``): its whole file system is not mounted."""
    spec = ExperimentSpec.model_validate({**tiny(), "model": {"kind": "custom", "factory": "m:build"},
                                          "code": {"package": "sha256:" + "0" * 64}})
    monkeypatch.chdir("/")
    with pytest.raises(sandbox.MountRefused, match="the job's code directory / holds the service's own files"):
        supervisor.mounts(spec, node / "storage" / "job-a", None)
    monkeypatch.setenv("PYTHONPATH", str(node))  # a working_dir that would hold the home: refused too
    with pytest.raises(sandbox.MountRefused):
        supervisor.mounts(spec, node / "storage" / "job-a", None)
    assert os.getcwd() == "/"


def test_a_python_path_of_slash_binds_nothing_of_the_whole_file_system(node: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray worker started from ``/`` has ``/`` on ``sys.path``; the checkout holding the service's home (``make
    demo``'s ``runs/demo``) is on it too: neither is bound, only Python's and our packages' own directories."""
    monkeypatch.setattr(sys, "path", ["/", str(node.parent), *sys.path])
    box = sandbox.Mounts(writable=node / "storage" / "job-a", hidden=sandbox.hidden_dirs())
    argv = sandbox.bwrap_argv(["true"], {}, box)
    binds = {argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"}
    assert "/" not in binds and str(node.parent) not in binds and str(node) not in binds, binds
    for ours in sandbox.our_package_dirs():  # still there, on their own or under a directory that is
        assert any(Path(ours).resolve().is_relative_to(b) for b in binds), (ours, binds)
