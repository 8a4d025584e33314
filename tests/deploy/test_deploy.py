"""Offline checks of the deployment files: docker-compose.yml, deploy/Dockerfile.*, .env.example and
deploy/k8s/. Nothing is built or started here (no Docker, no cluster): the compose file is validated
against the compose spec (check-jsonschema's vendored schema), the core Kubernetes kinds against the
Kubernetes OpenAPI schemas that kubernetes-validate ships, and the rest by cross-references between the
files (names, labels, secret keys, claims, ports, env vars)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.core.settings import Settings
from tests.deploy.manifests import (
    COMPOSE,
    DEPLOY_ONLY_VARS,
    DOCKERFILES,
    ENV_EXAMPLE,
    K8S,
    ROOT,
    RUNTIME_VARS,
    compose,
    container_env,
    containers,
    env_example,
    image_pinned,
    service_env,
    services,
    workload,
)


# ---- docker compose -----------------------------------------------------------------------------
def test_compose_validates_against_the_compose_spec() -> None:
    exe = Path(sys.executable).with_name("check-jsonschema")
    cmd = str(exe) if exe.exists() else shutil.which("check-jsonschema")
    assert cmd, "check-jsonschema is missing: pip install -e '.[dev]'"
    done = subprocess.run([cmd, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_has_the_five_services() -> None:
    assert set(services()) == {"redis", "ray-head", "ray-worker", "api", "scheduler"}


def test_compose_depends_on_targets_exist_and_healthy_ones_have_healthchecks() -> None:
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for target, how in deps.items():
            assert target in svcs, f"{name} depends on unknown service {target}"
            assert target != name
            if how.get("condition") == "service_healthy":
                assert "healthcheck" in svcs[target], f"{name} waits for {target} to be healthy: it has no healthcheck"


def test_compose_named_volumes_are_declared() -> None:
    doc = compose()
    declared = set(doc.get("volumes") or {})
    used = set()
    for svc in doc["services"].values():
        for vol in svc.get("volumes", []):
            if isinstance(vol, str):
                source = vol.split(":", 1)[0] if ":" in vol else ""
                kind = "bind" if source.startswith((".", "/", "~", "$")) else "volume"
            else:
                source, kind = vol.get("source", ""), vol.get("type", "volume")
            if kind == "volume" and source:
                used.add(source)
    assert used, "no named volumes (redis data and checkpoints should be)"
    assert used <= declared, f"undeclared volumes: {used - declared}"
    assert declared <= used, f"declared but unused volumes: {declared - used}"


def test_compose_every_service_has_a_healthcheck_and_restarts() -> None:
    for name, svc in services().items():
        check = svc.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name}: no healthcheck"
        assert svc.get("restart") == "unless-stopped", f"{name}: restart is {svc.get('restart')!r}"


def test_compose_images_are_pinned_and_builds_have_their_dockerfile() -> None:
    for name, svc in services().items():
        assert image_pinned(svc.get("image", "")), f"{name}: image {svc.get('image')!r} has no pinned tag"
        build = svc.get("build")
        if build is not None:
            build = {"context": build} if isinstance(build, str) else build
            context = ROOT / build.get("context", ".")
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
    # one image per Dockerfile: services that share an image build it from the same file
    by_image: dict[str, set[str]] = {}
    for svc in services().values():
        if "build" in svc:
            by_image.setdefault(svc["image"], set()).add(svc["build"]["dockerfile"])
    assert all(len(files) == 1 for files in by_image.values()), by_image


def test_compose_publishes_only_the_api_on_loopback() -> None:
    svcs = services()
    for name in ("redis", "ray-head", "ray-worker", "scheduler"):
        assert not svcs[name].get("ports"), f"{name} publishes host ports"
        assert svcs[name].get("network_mode") != "host", f"{name} uses the host network"
    ports = svcs["api"]["ports"]
    assert ports
    for port in ports:
        host_ip = port.split(":")[0] if isinstance(port, str) else port.get("host_ip")
        assert host_ip == "127.0.0.1", f"api publishes {port!r} beyond loopback"
    assert service_env(svcs["api"])["TLAB_BIND"] == "0.0.0.0"  # inside the container, for the published port


def test_compose_ray_uses_token_auth_from_the_env_file() -> None:
    svcs = services()
    for name in ("ray-head", "ray-worker", "api", "scheduler"):
        assert service_env(svcs[name]).get("RAY_AUTH_MODE") == "token", name
        env_file = svcs[name].get("env_file")
        files = [env_file] if isinstance(env_file, str) else [e if isinstance(e, str) else e["path"]
                                                               for e in env_file or []]
        # every job inherits a Ray node's environment: the Ray nodes get the token, none of .env's secrets
        assert (".env" in files) == (name in ("api", "scheduler")), f"{name}: env_file {files}"
        if name.startswith("ray-"):
            assert set(service_env(svcs[name])) == {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, name
    assert "RAY_AUTH_TOKEN" in env_example()
    head = " ".join(svcs["ray-head"]["command"])
    assert "--head" in head and "--block" in head and "--dashboard-host=0.0.0.0" in head
    worker = " ".join(svcs["ray-worker"]["command"])
    assert "--address=ray-head:6379" in worker and "--block" in worker


def test_compose_service_env_points_at_redis_and_the_ray_head() -> None:
    svcs = services()
    for name in ("api", "scheduler"):
        env = service_env(svcs[name])
        assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD:\?[^}]+\}@redis:6379/0", env["REDIS_URL"]), env["REDIS_URL"]
        assert env["RAY_ADDRESS"] == "http://ray-head:8265"
    assert svcs["api"]["command"][-1].strip().endswith("exec python -m service.api")
    assert svcs["scheduler"]["command"] == ["python", "-m", "service.scheduler"]
    redis_cmd = svcs["redis"]["command"][-1]  # a password always, not only when one is set
    assert '--requirepass "$$REDIS_PASSWORD"' in redis_cmd and ":+" not in redis_cmd


def test_admin_bootstrap_is_a_real_tlab_command() -> None:
    """compose's api command and the k8s init container run `tlab admin bootstrap`, with the env it reads."""
    import shlex

    from service.cli import build_parser

    compose_cmd = services()["api"]["command"][-1].split("&&")[0]
    init = next(c for c in workload("tlab-api")["spec"]["template"]["spec"]["initContainers"]
                if c["name"] == "ensure-admin")
    for argv in (shlex.split(compose_cmd), init["command"]):
        assert argv[:3] == ["tlab", "admin", "bootstrap"], argv
        assert build_parser().parse_args(argv[1:]).func.__name__ == "cmd_admin_bootstrap"
    assert {"REDIS_URL", "TLAB_ADMIN_TOKEN"} <= set(container_env(init))
    assert "TLAB_ADMIN_TOKEN" in env_example() and "REDIS_URL" in service_env(services()["api"])


def test_compose_gpu_worker_is_scalable() -> None:
    worker = services()["ray-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    for fixed in ("container_name", "hostname", "ports"):
        assert fixed not in worker, f"ray-worker sets {fixed}: --scale ray-worker=N would clash"


def test_compose_checkpoints_are_shared_at_the_scheduler_storage_path() -> None:
    svcs = services()
    storage = service_env(svcs["scheduler"])["TLAB_STORAGE"]
    mounts = {}
    for name in ("ray-head", "ray-worker", "scheduler"):
        mounts[name] = {v.split(":")[0]: v.split(":")[1] for v in svcs[name]["volumes"] if isinstance(v, str)}
    sources = {src for m in mounts.values() for src, dst in m.items() if dst == storage}
    assert len(sources) == 1, f"{storage} is not one shared volume on head, workers and scheduler: {mounts}"


def test_compose_interpolated_variables_are_in_env_example() -> None:
    text = "\n".join(line for line in COMPOSE.read_text().splitlines() if not line.lstrip().startswith("#"))
    text = text.replace("$$", "")  # $$ escapes a $ for the container's shell
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    assert used <= set(env_example()), f"not in .env.example: {used - set(env_example())}"


def test_env_example_and_gitignore() -> None:
    example = env_example()
    assert {"RAY_AUTH_TOKEN", "TLAB_ADMIN_TOKEN", "REDIS_PASSWORD"} <= set(example)
    assert "secrets.token_hex(32)" in ENV_EXAMPLE.read_text()
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert ignored & {".env", "/.env"}, ".env is not in .gitignore"


# ---- Dockerfiles --------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfiles_exist() -> None:
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile.service", "Dockerfile.worker"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_pinned_base_and_non_root_user(path: Path) -> None:
    steps = instructions(path)
    froms = [rest.split()[0] for word, rest in steps if word == "FROM"]
    assert froms, f"{path.name}: no FROM"
    for image in froms:
        assert image_pinned(image), f"{path.name}: FROM {image} is not pinned"
    users = [rest for word, rest in steps if word == "USER"]
    assert users, f"{path.name}: no USER (runs as root)"
    assert users[-1].split(":")[0] not in ("root", "0"), f"{path.name}: the final USER is root"
    # the last instruction that runs the image's command comes after the final USER
    assert [w for w, _ in steps].index("USER") < [w for w, _ in steps].index("CMD")


def test_dockerfiles_share_the_interpreter_path() -> None:
    """The scheduler submits each experiment as ``<its sys.executable> -m workers.run``: the service image's
    interpreter must exist, with the project installed, at the same path on the Ray nodes."""
    setups = {}
    for path in DOCKERFILES:
        steps = instructions(path)
        base = next(rest.split()[0] for word, rest in steps if word == "FROM")
        venv = re.search(r"python -m venv (\S+)", path.read_text())
        assert venv, f"{path.name}: no venv"
        assert any(w == "RUN" and "pip install ." in rest for w, rest in steps), f"{path.name}: project not installed"
        setups[path.name] = (base.split(":")[0], tuple(base.split(":")[1].split(".")[:2]), venv.group(1))
    assert len(set(setups.values())) == 1, setups


def test_service_image_uses_the_cpu_torch_wheel() -> None:
    runs = [rest for word, rest in instructions(ROOT / "deploy" / "Dockerfile.service") if word == "RUN"]
    cpu = [i for i, r in enumerate(runs) if "--index-url https://download.pytorch.org/whl/cpu" in r and "torch" in r]
    project = [i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r)]
    assert cpu and project and cpu[0] < project[0], "install the CPU torch wheel before the project"



# ---- environment variables ------------------------------------------------------------------------
def known_env_vars() -> set[str]:
    """Settings' aliases plus every RAY_/TLAB_ name the code reads, plus Ray's own and deploy-only ones."""
    names = {f.validation_alias for f in Settings.model_fields.values() if isinstance(f.validation_alias, str)}
    names |= {"REDIS_URL"}
    for package in ("service", "workers", "teleport"):
        for src in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"[\"']((?:TLAB|RAY)_[A-Z0-9_]+)[\"']", src.read_text()))
    return names | RUNTIME_VARS | DEPLOY_ONLY_VARS


def deployed_service_env() -> dict[str, set[str]]:
    """Env var names the deployment gives the API and the scheduler, by where they are set."""
    out: dict[str, set[str]] = {}
    for name in ("api", "scheduler"):
        svc = services()[name]
        out[f"compose {name}"] = set(service_env(svc)) | set(env_example())  # env_file: .env
    for name in ("tlab-api", "tlab-scheduler"):
        for c in containers(workload(name)["spec"]["template"]):
            out[f"k8s {name}/{c['name']}"] = set(container_env(c))
    return out


def test_service_env_vars_are_known() -> None:
    known = known_env_vars()
    assert {"REDIS_URL", "RAY_ADDRESS", "TLAB_STORAGE", "TLAB_BIND", "TLAB_PORT"} <= known
    for where, names in deployed_service_env().items():
        unknown = names - known
        assert not unknown, f"{where}: unknown env vars {sorted(unknown)} (a typo? Settings has no such alias)"


def test_deploy_only_vars_are_used() -> None:
    """The allowance for vars no Python code reads must not hide dead or misspelt ones."""
    texts = COMPOSE.read_text() + "".join(p.read_text() for p in K8S.glob("*.yaml"))
    for name in DEPLOY_ONLY_VARS:
        uses = texts.count(name)
        assert uses >= 2, f"{name} is set but never read by a command"  # set once, read at least once
    assert not Settings.model_fields.keys() & {v.lower() for v in DEPLOY_ONLY_VARS}


def test_env_var_check_catches_a_typo() -> None:
    assert "TLAB_TICKS" not in known_env_vars()
    assert "TLAB_TICK_S" in known_env_vars()
