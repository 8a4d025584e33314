"""The wheels a lent GPU machine lacks, fetched here and carried there, under the device call's 64 MiB.

The device tool's machines (H100, H200) run Python 3.12 with torch, numpy, pytest and ~200 other packages
(``image_packages.txt``, from the tool's KINDS.md), but not Ray, FastAPI, pydantic or Redis, and nothing can be
fetched there. So ``gpu_checks.sh``'s service parts (a 2 x 0.5 GPU gang and a 4-trial 0.25-GPU sweep
through ``tlab up``) never ran on a GPU: Ray's wheel alone is 79 MB, and a call carries 64 MiB, the working tree
included. This builds ``.whl/`` (git-ignored), what the project needs and the image lacks:

1. resolve the project's dependencies (``pyproject.toml``; torch and optuna left out: the image has torch, and
   optuna is imported only by a sweep that asks for it) for CPython 3.12 on manylinux x86-64 with
   ``pip install --dry-run --report``, pinned to the versions of the local ``.venv`` (what CI tests) where it has one;
2. drop what the image has (by name), but for ``FORCE`` and the pure-Python packages a carried one requires (their
   version there is unknown), and ``SKIP`` (Ray extras no check runs);
3. download the rest, and slim Ray's wheel: no Java jars (32 MB), no RLlib, Serve or LLM, and its members
   re-compressed with LZMA (pip unpacks wheels with ``zipfile``, which reads LZMA): 79 -> 33 MB;
4. check the total against ``--limit-mb`` (default 56: 64 MiB less the working tree and a margin).

    python3 benchmarks/device/carry.py [--python 3.12] [--dest .whl] [--limit-mb 56]

Then one device call runs everything: ``run(command="bash benchmarks/device/run_checks.sh", carry=[".whl"],
timeout_s=600)``. Re-running reuses what ``--dest`` already holds. ``--image-part FILE`` also writes the pins of
the resolved packages the image provides, for a stand-in of the image on this machine (docs/operations.md).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = Path(__file__).with_name("image_packages.txt")
LEFT_OUT_REQS = {"torch": "the image has its own CUDA build", "optuna": "only a sweep with searcher optuna imports it"}
SKIP = {  # resolved, not carried: what no check imports (ray[default]'s runtime_env and profiling extras)
    "virtualenv": "Ray's runtime_env pip/virtualenv plugins (the checks use working_dir only)",
    "distlib": "virtualenv's", "python-discovery": "virtualenv's",
    "py-spy": "the Ray dashboard's stack sampling",
}
FORCE = {  # carried although the image has them: the version there is unknown and a mismatch breaks an import
    "protobuf": "Ray's and OpenTelemetry's generated code need a protobuf of their own major version",
}
KEEP_IMAGES = {"setuptools"}  # required by a carried package, but any version the image has will do
RAY_DROPPED = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/llm/")
PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==\S+")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(requirement: str) -> str:
    """``ray[default]==2.60.0 ; python_version < "4"`` -> ``ray``."""
    return norm(re.split(r"[\s<>=!~\[;(]", requirement, maxsplit=1)[0])


def wheel_pin(wheel: Path) -> str:
    """``pydantic_core-2.50.5-cp312-...whl`` -> ``pydantic-core==2.50.5`` (a wheel's name and version, normalised)."""
    name, version = wheel.name.split("-")[:2]
    return f"{norm(name)}=={version}"


def image_packages(path: Path = IMAGE) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {norm(line) for line in lines if line}


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's runtime dependencies, less ``LEFT_OUT_REQS``."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if req_name(d) not in LEFT_OUT_REQS]


def local_pins(venv: Path = ROOT / ".venv") -> list[str]:
    """``name==version`` of every package in the local venv (what CI tests), torch's builds and ours left out."""
    python = venv / "bin" / "python"
    if not python.exists():
        return []
    frozen = subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                            check=True).stdout.splitlines()  # (an editable install is a comment and a "-e" line)
    return [p for p in frozen if PIN.fullmatch(p) and "+" not in p and not norm(p).startswith(("torch", "nvidia-"))]


def platform_args(python: str) -> list[str]:
    tag = python.replace(".", "")
    return ["--only-binary=:all:", "--python-version", tag, "--implementation", "cp",
            *[a for p in PLATFORMS for a in ("--platform", p)]]


@dataclass(frozen=True)
class Resolved:
    version: str
    pure: bool  # a py3-none-any wheel: small, and the same on any Python
    requires: frozenset[str]  # the names it requires outside its extras


def resolve(python: str, reqs: list[str], pins: list[str]) -> dict[str, Resolved]:
    """Everything ``reqs`` installs on the target, with ``pins`` as constraints, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        req, con, report = Path(tmp, "req.txt"), Path(tmp, "con.txt"), Path(tmp, "report.json")
        req.write_text("\n".join(reqs) + "\n")
        con.write_text("\n".join(pins) + "\n")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--disable-pip-version-check", "--report", str(report), "--target", str(Path(tmp, "t")),
                        *platform_args(python), "-r", str(req), "-c", str(con)], check=True)
        installs = json.loads(report.read_text())["install"]
    return {norm(i["metadata"]["name"]): Resolved(
        i["metadata"]["version"], i["download_info"]["url"].endswith("-none-any.whl"),
        frozenset(req_name(r) for r in i["metadata"].get("requires_dist") or [] if "extra ==" not in r))
        for i in installs}


def chosen(resolved: dict[str, Resolved], image: set[str]) -> set[str]:
    """What to carry: what the image lacks, ``FORCE``, and the pure-Python packages of the image that a carried one
    requires (the image's version is unknown and may be older than it asks; these are small), less ``SKIP``."""
    carried = {n for n in resolved if (n not in image or n in FORCE) and n not in SKIP}
    while more := {d for n in carried for d in resolved[n].requires
                   if d in image and d in resolved and resolved[d].pure and d not in KEEP_IMAGES} - carried:
        carried |= more
    return carried


def download(python: str, pins: list[str], dest: Path) -> None:
    """The wheels of ``pins`` (``name==version``, normalised) that ``dest`` does not hold yet."""
    have = {wheel_pin(w) for w in dest.glob("*.whl")}
    wanted = [p for p in pins if p not in have]
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
                        *platform_args(python), "-d", str(dest), *wanted], check=True)


def slim_ray(wheel: Path) -> Path:
    """Ray's wheel without ``RAY_DROPPED`` (its RECORD too), every member LZMA-compressed; replaces ``wheel``."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", compression=zipfile.ZIP_LZMA) as out:
        for info in src.infolist():
            if info.filename.startswith(RAY_DROPPED):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines(keepends=True)
                data = "".join(r for r in rows if not r.startswith(RAY_DROPPED)).encode()
            info.compress_type = zipfile.ZIP_LZMA
            out.writestr(info, data)
    slim.replace(wheel)
    (wheel.parent / "ray.slimmed").write_text(wheel.name + "\n")
    return wheel


def tree_bytes() -> int:
    """What a device call sends besides the carry: tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def build(python: str, dest: Path, limit_mb: float, image_part: Path | None, venv: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    image, pins = image_packages(), local_pins(venv)
    resolved = resolve(python, requirements(), pins)
    carried = chosen(resolved, image)
    if image_part is not None:
        image_part.write_text("".join(f"{n}=={r.version}\n" for n, r in sorted(resolved.items()) if n in image))
    pins_carried = [f"{n}=={resolved[n].version}" for n in sorted(carried)]
    download(python, pins_carried, dest)
    ray = next(dest.glob("ray-*.whl"), None)
    slimmed = dest / "ray.slimmed"
    if ray is not None and not (slimmed.exists() and slimmed.read_text().strip() == ray.name):
        print(f"slimming {ray.name} (LZMA: a few minutes)", flush=True)
        slim_ray(ray)
    wheels = sorted(dest.glob("*.whl"))
    stray = [w.name for w in wheels if wheel_pin(w) not in pins_carried]  # (another version: two stop the install)
    total, tree = sum(w.stat().st_size for w in wheels), tree_bytes()
    for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:8]:
        print(f"{w.stat().st_size / 1e6:8.2f} MB  {w.name}")
    print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB (limit {limit_mb} MB); the working tree {tree / 1e6:.1f} MB; "
          f"resolved {len(resolved)}, carried {len(carried)}, "
          f"skipped {sorted(SKIP.keys() & resolved)}")
    if stray:
        print(f"{dest}: wheels no longer resolved (or of another version): {', '.join(stray)}: delete them")
        return 1
    if total > limit_mb * 1e6:
        print(f"{dest}: {total / 1e6:.1f} MB is over --limit-mb {limit_mb}: a device call carries 64 MiB in all")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="the device's Python (default 3.12, the image's)")
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="where the wheels go (default .whl)")
    parser.add_argument("--limit-mb", type=float, default=56.0, help="the most the wheels may weigh (default 56)")
    parser.add_argument("--image-part", type=Path, default=None,
                        help="also write the pins of the resolved packages the image provides to this file")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv",
                        help="pin the versions this venv has (default .venv, what make test installs; none: unpinned)")
    args = parser.parse_args(argv)
    return build(args.python, args.dest, args.limit_mb, args.image_part, args.venv)


if __name__ == "__main__":
    sys.exit(main())
