"""What the deployment files hold, read for the offline checks in test_deploy.py (docker compose, Dockerfiles,
environment variables) and test_k8s.py (the Kubernetes manifests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

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
