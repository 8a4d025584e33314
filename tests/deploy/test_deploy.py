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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = sorted((ROOT / "deploy").glob("Dockerfile.*"))
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are checked against

# read by the deployment files themselves rather than by Python code: redis-server's --requirepass
DEPLOY_ONLY_VARS = {"REDIS_PASSWORD"}
# read by Ray or the runtime, not by this project's code
RUNTIME_VARS = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED",
                "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED"}


# ---- helpers ------------------------------------------------------------------------------------
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip()
    return out


def service_env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def image_pinned(image: str) -> bool:
    """``name:tag`` (or ``@sha256:``) with a tag other than ``latest``; a registry port is not a tag."""
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return False
    tag = last.rsplit(":", 1)[1]
    return bool(tag) and tag != "latest" and "$" not in tag


def k8s_docs() -> dict[str, list[dict[str, Any]]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
            for p in sorted(K8S.glob("*.yaml"))}


def all_k8s() -> list[dict[str, Any]]:
    return [d for name, docs in k8s_docs().items() if name != "kustomization.yaml" for d in docs]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in all_k8s() if d["kind"] == kind]


def pod_templates() -> Iterator[tuple[str, dict[str, Any]]]:
    """(owner, pod template) for every workload, RayCluster head and worker groups included."""
    for d in all_k8s():
        name = d["metadata"]["name"]
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield name, d["spec"]["template"]
        elif d["kind"] == "RayCluster":
            yield f"{name}/head", d["spec"]["headGroupSpec"]["template"]
            for group in d["spec"].get("workerGroupSpecs", []):
                yield f"{name}/{group['groupName']}", group["template"]


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def walk(node: Any, key: str) -> Iterator[Any]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item, key)


def workload(name: str) -> dict[str, Any]:
    (found,) = [d for d in all_k8s() if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == name]
    return found


def container_env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


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
        assert ".env" in files, f"{name} does not read .env"
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



# ---- Kubernetes ---------------------------------------------------------------------------------
def test_k8s_manifests_parse_with_kind_and_api_version() -> None:
    docs = k8s_docs()
    assert {"raycluster.yaml", "api.yaml", "scheduler.yaml", "redis.yaml", "secret.example.yaml", "storage.yaml",
            "ingress.yaml", "kustomization.yaml"} <= set(docs)
    for name, items in docs.items():
        assert items, f"{name} is empty"
        for d in items:
            assert d.get("apiVersion") and d.get("kind"), f"{name}: a document without apiVersion/kind"
            if d["kind"] != "Kustomization":
                assert d.get("metadata", {}).get("name"), f"{name}: {d['kind']} without a name"


def test_k8s_core_kinds_validate_against_the_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    skipped = set()
    for d in all_k8s():
        try:
            kv.validate(d, K8S_VERSION, strict=True)
        except kv.SchemaNotFoundError:
            skipped.add(d["kind"])
        except kv.ValidationError as err:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']}: {err}")
    assert skipped <= {"RayCluster"}, f"no schema for {skipped}"  # the KubeRay CRD is not in the core schemas


def test_k8s_names_are_unique_per_kind() -> None:
    seen = [(d["kind"], d["metadata"]["name"]) for d in all_k8s()]
    assert len(seen) == len(set(seen)), seen


def test_k8s_workload_selectors_match_their_pod_labels() -> None:
    for d in all_k8s():
        if d["kind"] in ("Deployment", "StatefulSet"):
            selector = d["spec"]["selector"]["matchLabels"]
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert selector and selector.items() <= labels.items(), d["metadata"]["name"]


def test_k8s_service_selectors_match_some_pods() -> None:
    labels = [t["metadata"].get("labels", {}) for _, t in pod_templates()]
    for svc in of_kind("Service"):
        selector = svc["spec"]["selector"]
        assert any(selector.items() <= lab.items() for lab in labels), f"{svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):  # a named port must exist on the pods it selects
                pods = [t for _, t in pod_templates() if selector.items() <= t["metadata"].get("labels", {}).items()]
                names = {p.get("name") for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
                assert target in names, f"Service {svc['metadata']['name']}: no container port named {target}"
    sts = workload("tlab-redis")
    assert sts["spec"]["serviceName"] in {s["metadata"]["name"] for s in of_kind("Service")
                                          if s["spec"].get("clusterIP") == "None"}


def test_k8s_secret_refs_exist_in_the_example_secret() -> None:
    secrets = {}
    for s in of_kind("Secret"):
        secrets[s["metadata"]["name"]] = set(s.get("stringData", {})) | set(s.get("data", {}))
    assert secrets.get("tlab-secrets", set()) >= {"ray-auth-token", "admin-token", "redis-password"}
    refs = list(walk(all_k8s(), "secretKeyRef"))
    assert refs
    for ref in refs:
        assert ref["name"] in secrets, f"unknown secret {ref['name']}"
        assert ref["key"] in secrets[ref["name"]], f"secret {ref['name']} has no key {ref['key']}"


def test_k8s_claims_and_volumes_are_defined() -> None:
    claims = {p["metadata"]["name"] for p in of_kind("PersistentVolumeClaim")}
    assert "tlab-checkpoints" in claims
    assert "ReadWriteMany" in of_kind("PersistentVolumeClaim")[0]["spec"]["accessModes"]
    for d in all_k8s():
        for pvc in walk(d, "persistentVolumeClaim"):
            assert pvc["claimName"] in claims, f"{d['metadata']['name']}: unknown claim {pvc['claimName']}"
    # every volumeMount names a pod volume or a volumeClaimTemplate of its workload
    for d in all_k8s():
        if d["kind"] not in ("Deployment", "StatefulSet", "RayCluster"):
            continue
        templates = {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
        for owner, template in pod_templates():
            if owner.split("/")[0] != d["metadata"]["name"]:
                continue
            volumes = {v["name"] for v in template["spec"].get("volumes", [])} | templates
            for c in containers(template):
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes, f"{owner}/{c['name']}: no volume {m['name']}"


def test_k8s_checkpoints_shared_by_ray_and_the_scheduler_at_tlab_storage() -> None:
    (sched,) = workload("tlab-scheduler")["spec"]["template"]["spec"]["containers"]
    storage = container_env(sched)["TLAB_STORAGE"]
    mounted = []
    for owner, template in pod_templates():
        by_volume = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
                     for v in template["spec"].get("volumes", [])}
        for c in template["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                if m["mountPath"] == storage:
                    mounted.append((owner, by_volume.get(m["name"])))
    owners = {o for o, _ in mounted}
    assert {"tlab/head", "tlab/gpu", "tlab-scheduler"} <= owners, mounted
    assert {claim for _, claim in mounted} == {"tlab-checkpoints"}, mounted


def test_k8s_ray_cluster_token_auth_and_gpus() -> None:
    (rc,) = of_kind("RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    for owner, template in pod_templates():
        if not owner.startswith(rc["metadata"]["name"] + "/"):
            continue
        (c,) = template["spec"]["containers"]
        env = container_env(c)
        assert env["RAY_AUTH_MODE"] == "token", owner
        assert env["RAY_AUTH_TOKEN"]["secretKeyRef"]["key"] == "ray-auth-token", owner
    groups = rc["spec"]["workerGroupSpecs"]
    assert any(int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0
               for g in groups)


def test_k8s_service_env_points_at_redis_and_the_ray_head() -> None:
    (rc,) = of_kind("RayCluster")
    redis = workload("tlab-redis")
    redis_host = f"{redis['metadata']['name']}-0.{redis['spec']['serviceName']}"
    for name in ("tlab-api", "tlab-scheduler"):
        for c in containers(workload(name)["spec"]["template"]):
            env = container_env(c)
            assert env["REDIS_URL"] == f"redis://:$(REDIS_PASSWORD)@{redis_host}:6379/0", name
            names = [e["name"] for e in c["env"]]  # Kubernetes expands $(VAR) only for a VAR defined earlier
            assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL"), name
            assert env["REDIS_PASSWORD"]["secretKeyRef"]["key"] == "redis-password", name
            if c["name"] != "ensure-admin":
                assert env["RAY_ADDRESS"] == f"http://{rc['metadata']['name']}-head-svc:8265", name
                assert env["RAY_AUTH_MODE"] == "token"
    assert workload("tlab-scheduler")["spec"]["replicas"] == 1
    redis_container = redis["spec"]["template"]["spec"]["containers"][0]
    redis_args = redis_container["args"]
    assert redis_args[redis_args.index("--appendonly") + 1] == "yes"
    assert redis_args[redis_args.index("--appendfsync") + 1] == "always"  # acknowledged = on disk
    assert redis_args[redis_args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    redis_env = container_env(redis_container)
    for name in ("REDIS_PASSWORD", "REDISCLI_AUTH"):  # the server's password, and the probes' redis-cli
        assert redis_env[name]["secretKeyRef"]["key"] == "redis-password", name


def test_k8s_ingress_backend_exists() -> None:
    services_by_name = {s["metadata"]["name"]: s for s in of_kind("Service")}
    (ing,) = of_kind("Ingress")
    assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    backends = [p["backend"]["service"] for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
    assert backends
    for b in backends:
        svc = services_by_name.get(b["name"])
        assert svc, f"Ingress backend {b['name']} is no Service"
        ports = svc["spec"]["ports"]
        if "name" in b["port"]:
            assert b["port"]["name"] in {p.get("name") for p in ports}
        else:
            assert b["port"]["number"] in {p["port"] for p in ports}


def test_k8s_images_pinned_and_pods_non_root() -> None:
    kustom = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    rewritten = {i["name"]: i for i in kustom.get("images", [])}
    for owner, template in pod_templates():
        assert template["spec"].get("securityContext", {}).get("runAsNonRoot") is True, owner
        for c in containers(template):
            assert image_pinned(c["image"]), f"{owner}/{c['name']}: {c['image']}"
            name = c["image"].rsplit(":", 1)[0]
            if name.startswith("teleport-lab-"):  # ours: kustomization points it at the lab's registry
                assert name in rewritten and rewritten[name]["newTag"] != "latest", name


def test_kustomization_lists_every_manifest() -> None:
    kustom = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} | {p.name for p in K8S.glob("*.yml")}
    assert sorted(kustom["resources"]) == sorted(files - {"kustomization.yaml"})


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
