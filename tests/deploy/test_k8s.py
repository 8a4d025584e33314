"""Offline checks of deploy/k8s/: the core kinds validated against the Kubernetes OpenAPI schemas that
kubernetes-validate ships, the rest by cross-references (names, labels, selectors, secret keys, claims, env vars,
token auth, images and non-root pods). Nothing is applied to a cluster."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.manifests import (
    K8S,
    K8S_VERSION,
    all_k8s,
    container_env,
    containers,
    image_pinned,
    k8s_docs,
    of_kind,
    pod_templates,
    walk,
    workload,
)


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
