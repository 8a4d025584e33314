"""Admission at submit over real HTTP, a real Redis and the real API process: what can never run
is refused with a 422 naming the field, data is read only under the data roots, and the limits hold."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest

from api_schemas.datasets import MNIST_FILES
from tests.service.conftest import Api, tiny


@pytest.fixture()
def api_env(tmp_path: Path) -> dict[str, str]:
    """Two data roots (``roots/a``, ``roots/b``) and at most 2 SSE streams per user."""
    roots = [tmp_path / "roots" / "a", tmp_path / "roots" / "b"]
    for r in roots:
        r.mkdir(parents=True)
    return {"TLAB_DATA_ROOTS": ":".join(map(str, roots)), "TLAB_MAX_STREAMS_PER_USER": "2"}


@pytest.fixture()
def api(api_only: Api) -> Api:
    return api_only


def roots(api: Api) -> list[Path]:
    return [Path(p).resolve() for p in api.stack.extra_env["TLAB_DATA_ROOTS"].split(":")]


def post(c: httpx.Client, spec: dict[str, Any], **kw: Any) -> httpx.Response:
    return c.post("/v1/experiments", json={"spec": spec, **kw})


def refused(r: httpx.Response, field: str, *words: str) -> str:
    """The 422's message for ``field``, after checking the one-line body names it (and ``words``)."""
    assert r.status_code == 422, r.text
    body = r.json()
    assert [e["field"] for e in body["errors"]] == [field], body
    message = body["errors"][0]["message"]
    assert "\n" not in body["detail"] and all(w in message for w in words), message
    return message


def with_model(spec: dict[str, Any], **model: Any) -> dict[str, Any]:
    return {**spec, "model": model}


def mnist_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in MNIST_FILES:
        (path / name).write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x00")  # existence is what submit checks
    return path


def test_statically_wrong_specs_are_refused_naming_the_field(api: Api) -> None:
    api.add_user("alice", max_gpus=0, max_priority=2)
    with api.client("alice") as c:
        r = post(c, with_model(tiny(), kind="transformer"))  # digits are images (1, 8, 8)
        refused(r, "spec.model", "model.kind=transformer needs sequence input", "(1, 8, 8)", "model.kind=cnn")
        r = post(c, with_model(tiny(dataset={"name": "ptb", "root": "data/ptb"}), kind="cnn"))  # before the files
        refused(r, "spec.model", "cannot do language modelling")
        r = post(c, with_model(tiny(dataset={"name": "electricity", "root": "x"}), kind="cnn"))
        refused(r, "spec.model", "needs image input", "(168, D)")
        refused(post(c, tiny(training={"epochs": 1001})), "spec.training.epochs", "TLAB_MAX_EPOCHS")
        refused(post(c, tiny(model={"hidden": [20_000]})), "spec.model.hidden", "TLAB_MAX_WIDTH")
        refused(post(c, tiny(model={"hidden": [8] * 129})), "spec.model.hidden", "TLAB_MAX_LAYERS")
        teleport = {"enabled": True, "batches": 100, "epochs": list(range(60))}
        r = post(c, tiny(training={"epochs": 50}, teleport=teleport))
        refused(r, "spec.teleport.batches", "5000", "TLAB_MAX_TELEPORT_BATCHES")  # 100 x the 50 epochs that run
        r = post(c, tiny(resources={"workers": 2000, "cpus_per_worker": 0.0005}))
        refused(r, "spec.resources.cpus_per_worker", "TLAB_MIN_CPUS_PER_WORKER")
        refused(post(c, tiny(resources={"gpus_per_worker": 1})), "spec.resources.gpus_per_worker", "max_gpus")
        refused(post(c, tiny(resources={"workers": 65})), "spec.resources.cpus_per_worker", "max_cpus")
        refused(post(c, tiny(), priority=3), "priority", "max_priority quota of 2")
        assert post(c, tiny(), priority=2).status_code == 201
        refused(post(c, tiny(), tags=["x" * 65]), "tags.0")
        r = c.post("/v1/experiments", params={"dry_run": "true"}, json={"spec": tiny(training={"epochs": 5000})})
        refused(r, "spec.training.epochs")  # a dry run is admitted the same way
        assert [j["priority"] for j in c.get("/v1/experiments").json()["items"]] == [2]  # nothing else queued
    with api.client() as c:  # an admin is not bound by max_priority
        assert post(c, tiny(), priority=50).status_code == 201


def test_gpu_asks_that_can_never_work_are_refused_naming_the_fields(api: Api) -> None:
    """A job sees no GPU it did not ask for; a share above one card is whole GPUs; a GPU model no node has is
    refused while the nodes are known (the fixture's two nodes have 1 GPU each, of no known model)."""
    with api.client() as c:
        r = post(c, tiny(training={"device": "cuda"}))
        refused(r, "spec.training.device", "spec.training.device=cuda but spec.resources.gpus_per_worker=0")
        refused(post(c, tiny(resources={"gpus_per_worker": 1.5})), "spec.resources", "whole number of GPUs")
        r = post(c, tiny(resources={"gpus_per_worker": 0.5, "gpu_type": "A100"}))
        refused(r, "spec.resources", "resources.gpu_type=A100 but no node has that GPU model (the cluster has: "
                "none known)")
        r = post(c, tiny(training={"device": "cuda"}, resources={"gpus_per_worker": 0.5, "gpu_memory_gb": 8}))
        assert r.status_code == 201, r.text  # a share of a card with its own memory limit


def test_data_is_read_only_under_the_data_roots(api: Api, tmp_path: Path) -> None:
    a, b = roots(api)
    mnist_dir(b / "mnist")
    outside = mnist_dir(tmp_path / "outside")
    (a / "escape").symlink_to(outside)
    (a / "elec").mkdir()
    (a / "elec" / "electricity.txt").symlink_to("/etc/passwd")
    np.savez(b / "own.npz", X=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    for corpus, train in ((b / "corpus", b / "corpus" / "train.bin"), (a / "leaky", a / "leaky" / "val.bin")):
        corpus.mkdir()
        np.arange(64, dtype=np.uint16).tofile(train)
    (b / "corpus" / "val.bin").write_bytes((b / "corpus" / "train.bin").read_bytes())
    np.arange(64, dtype=np.uint16).tofile(outside / "ids.bin")
    (a / "leaky" / "train.bin").symlink_to(outside / "ids.bin")
    with api.client() as c:
        r = post(c, tiny(dataset={"name": "mnist", "root": "data/mnist"}))  # a preset's root: found in root b
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["dataset"]["root"] == str(b / "mnist")  # the workers read what was checked
        got = c.get(f"/v1/experiments/{r.json()['id']}").json()["spec"]["dataset"]["root"]
        assert got == str(b / "mnist")
        refused(post(c, tiny(dataset={"name": "mnist", "root": "fashion"})), "spec.dataset.root",
                "expected train-images-idx3-ubyte", str(a / "fashion"))
        for escape in ("data/../../../outside", f"{a}/../../outside", str(outside), "escape"):
            message = refused(post(c, tiny(dataset={"name": "mnist", "root": escape})), "spec.dataset.root",
                              "outside the data roots")
            assert str(outside) not in message.replace(escape, "")  # where a link points is not told
        r = post(c, tiny(dataset={"name": "electricity", "root": "elec"}))
        message = refused(r, "spec.dataset.root", "electricity.txt is a link that leaves the data roots")
        assert "root:" not in message  # no line of /etc/passwd
        refused(post(c, tiny(dataset={"name": "npz", "path": "/etc/passwd"})), "spec.dataset.path", "outside")
        refused(post(c, tiny(dataset={"name": "npz", "path": "nope.npz"})), "spec.dataset.path", "no such file")
        r = post(c, tiny(dataset={"name": "npz", "path": "own.npz"}))
        assert r.status_code == 201 and r.json()["spec"]["dataset"]["path"] == str(b / "own.npz"), r.text
        tokens, lm = {"name": "tokens", "seq_len": 8}, {"kind": "transformer", "head_dim": 8}
        r = post(c, with_model(tiny(dataset={**tokens, "root": "corpus"}), **lm))  # nanoGPT's train.bin, val.bin
        assert r.status_code == 201 and r.json()["spec"]["dataset"]["root"] == str(b / "corpus"), r.text
        refused(post(c, tiny(dataset={**tokens, "root": "corpus"})), "spec.model", "cannot do language modelling")
        refused(post(c, with_model(tiny(dataset={**tokens, "root": "leaky"}), **lm)), "spec.dataset.root",
                "train.bin is a link that leaves the data roots")
        refused(post(c, with_model(tiny(dataset={**tokens, "root": "elec"}), **lm)), "spec.dataset.root",
                "expected train.bin and val.bin")
        refused(post(c, with_model(tiny(dataset={**tokens, "root": "corpus", "seq_len": 64}), **lm)),
                "spec.dataset.seq_len", "train.bin has 64 tokens, too few for one sample of dataset.seq_len=64")
        (b / "corpus" / "val.bin").write_bytes(b"\x00" * 129)  # 129 bytes: no whole number of uint16 ids
        refused(post(c, with_model(tiny(dataset={**tokens, "root": "corpus"}), **lm)), "spec.dataset.token_dtype",
                "val.bin has 129 bytes, not a whole number of uint16 token ids")


def sweep(c: httpx.Client, space: dict[str, Any], **kw: Any) -> httpx.Response:
    return c.post("/v1/sweeps", json={"base": tiny(), "search_space": space, **kw})


def test_sweeps_are_capped_and_each_axis_value_admitted(api: Api) -> None:
    with api.client() as c:
        t0 = time.perf_counter()
        r = sweep(c, {"training.seed": {"grid": list(range(150_000))}})
        took = time.perf_counter() - t0
        assert r.status_code == 422 and "150000 values; at most 1000" in r.json()["detail"], r.text[:300]
        print(f"150,000-value grid refused in {took * 1000:.0f} ms")
        r = sweep(c, {"training.seed": {"grid": list(range(100))}, "teleport.lr": {"grid": [0.1] * 11}})
        refused(r, "search_space", "1100 trials", "TLAB_MAX_TRIALS")
        r = sweep(c, {"training.epochs": {"choice": [2, 5000]}})
        refused(r, "search_space.training.epochs", "value 5000", "TLAB_MAX_EPOCHS")
        mnist_dir(roots(api)[0] / "mnist")  # a base whose files are there: each probed kind reads the same root
        r = c.post("/v1/sweeps", json={"base": tiny(dataset={"name": "mnist", "root": "mnist"}),
                                       "search_space": {"dataset.name": {"choice": ["mnist", "ptb"]}}})
        refused(r, "search_space.dataset.name", "value 'ptb'", "model.kind=mlp cannot do language modelling")
        r = c.post("/v1/sweeps", json={"base": tiny(dataset={"name": "mnist", "root": "mnist"}),
                                       "search_space": {"dataset.root": {"choice": ["a", "b"]}}})
        refused(r, "search_space.dataset.root", "one sweep per dataset location")
        r = c.post("/v1/sweeps", json={"base": tiny(dataset={"name": "mnist", "root": "/etc"}),
                                       "search_space": {"training.seed": {"grid": [0, 1]}}})
        refused(r, "base.dataset.root", "outside the data roots")
        assert sweep(c, {"training.seed": {"grid": [0, 1, 1, 2]}}).status_code == 201


def test_queued_jobs_are_capped_per_user_with_retry_after(api: Api) -> None:
    api.add_user("bob", max_queued_jobs=2)
    with api.client("bob") as c:
        first, _second = (post(c, tiny()).json()["id"] for _ in range(2))
        r = post(c, tiny())
        assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0, r.text
        assert r.json()["errors"][0]["field"] == "max_queued_jobs" and "max_queued_jobs" in r.json()["detail"]
        assert c.post(f"/v1/experiments/{first}/cancel").status_code == 202  # a slot frees up
        assert post(c, tiny()).status_code == 201
        assert post(c, tiny()).status_code == 429
    with api.client() as c:
        assert post(c, tiny()).status_code == 201  # bob's cap is his own (and admins have none)


def raw_post(url: str, token: str, length: int) -> tuple[int, bytes]:
    """POST headers announcing ``length`` bytes, send none of them, read the answer."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(f"POST /v1/experiments HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {token}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):  # the 413 closes the connection
            answer += chunk
    return int(answer.split()[1]), answer


def test_bodies_over_the_cap_are_refused_before_they_are_read(api: Api) -> None:
    status, head = raw_post(api.url, api.stack.admin_token, 5 * 2**20)  # 5 MB announced, not a byte sent
    assert status == 413 and b"1048576 bytes" in head, head[:400]

    def chunks() -> Iterator[bytes]:  # chunked: no Content-Length, counted as it comes
        yield b'{"spec": {"dataset": {"name": "digits"}}, "name": "'
        for _ in range(40):
            yield b"x" * 65536

    with api.client() as c:
        r = c.post("/v1/experiments", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["errors"][0]["field"] == "body", r.text
        assert "TLAB_MAX_BODY_BYTES" in r.json()["detail"]
        r = c.post("/v1/experiments", json={"spec": tiny(), "name": "y" * 300_000})  # under the cap: parsed
        refused(r, "name")
        assert c.get("/v1/experiments").json()["items"] == []


def test_ids_are_checked_compare_is_capped_and_streams_are_counted(api: Api) -> None:
    with api.client() as c:
        job = post(c, tiny()).json()["id"]
        sweep_id = sweep(c, {"training.seed": {"grid": [0, 1]}}).json()["id"]
        for path in (f"/v1/experiments/{sweep_id}:trials", f"/v1/sweeps/{sweep_id}:events",
                     f"/v1/experiments/{job}:events/metrics", "/v1/experiments/%0a"):
            r = c.get(path)
            assert r.status_code == 404 and r.json()["errors"][0]["field"] == "id", (path, r.text)
        r = c.get(f"/v1/experiments/{job}/plot.png", params={"compare": ",".join([job] * 25)})
        assert r.status_code == 200 and r.content[:4] == b"\x89PNG"  # the same run 25 times is one run
        others = [f"18f3a2b4c5d-00000{i}" for i in range(8)]
        r = c.get(f"/v1/experiments/{job}/plot.png", params={"compare": ",".join(others)})
        refused(r, "compare", "9 runs", "at most 8")
    stream = f"{api.url}/v1/experiments/{job}/events"
    with api.client() as c1, api.client() as c2, api.client() as c3:
        with c1.stream("GET", stream) as s1, c2.stream("GET", stream) as s2:
            assert s1.status_code == s2.status_code == 200
            with c3.stream("GET", stream) as s3:  # the third of a user's streams
                assert s3.status_code == 429 and "Retry-After" in s3.headers
                assert "TLAB_MAX_STREAMS_PER_USER" in json.loads(s3.read())["detail"]
        deadline = time.monotonic() + 30  # closed streams free their slots
        while True:
            with c3.stream("GET", stream) as s3:
                if s3.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the closed streams were never released"
            time.sleep(0.2)
