"""deploy/: every YAML parses, every config in it is a valid broker/node config, the compose
file, the Kubernetes manifests and the Dockerfiles point at things that exist, and the node
configs match the broker's manifest (a mismatching node would be refused at Join).

Static checks only (no Docker, no cluster): fast, and run everywhere."""

from __future__ import annotations

import fnmatch
import functools
import re
import shlex
from pathlib import Path

import pytest
import yaml

from graft_fed.broker.config import BrokerConfig, load_broker_config
from graft_fed.configbase import from_mapping
from graft_fed.node.node import NodeConfig, load_node_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CONFIGS = DEPLOY / "configs"
K8S = DEPLOY / "k8s"
DOCKER = DEPLOY / "docker"
NODE_CONFIGS = sorted(CONFIGS.glob("node-*.yaml"))
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


@functools.lru_cache(maxsize=None)
def _k8s_docs() -> tuple[dict, ...]:
    docs: list[dict] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    return tuple(docs)


def _by_kind(kind: str) -> list[dict]:
    return [d for d in _k8s_docs() if d["kind"] == kind]


@pytest.fixture(scope="module")
def broker() -> BrokerConfig:
    return load_broker_config(CONFIGS / "broker.yaml")


def test_every_yaml_under_deploy_parses():
    files = _yaml_files()
    assert len(files) >= 10, files
    for path in files:
        docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
        assert docs and all(isinstance(d, dict) for d in docs if d is not None), path


def test_broker_config_is_valid_and_reachable_from_other_containers(broker):
    assert broker.listen == "0.0.0.0:50551"
    assert broker.http.startswith("0.0.0.0:") and broker.http.endswith(":9464")
    assert broker.db.startswith("/var/lib/graft-fed/"), "broker state must live on the volume"


def test_three_node_configs_one_per_zoo_model_all_matching_the_manifest(broker):
    assert len(NODE_CONFIGS) == 3
    models = set()
    for path in NODE_CONFIGS:
        cfg = load_node_config(path)
        models.add(cfg.model.path)
        assert cfg.federation.broker == "broker:50551", path
        assert cfg.federation.federation_id in (None, broker.federation_id), path
        assert cfg.run.output_dir.startswith("/var/lib/graft-fed/"), path
        assert path.name == f"node-{cfg.node_id}.yaml"
        # The checked manifest fields (graft_fed/federation/manifest.py CHECKED_FIELDS):
        # equal data configs give equal dataset ids and hashes.
        assert cfg.data == broker.data, path
        assert cfg.run.seed == broker.seed, path
        assert cfg.rollout.n == broker.n, path
        assert cfg.algorithm.prompts_per_step == broker.prompts_per_round, path
        assert cfg.verifier.name == broker.verifier.name, path
        assert cfg.federation.max_message_mib == broker.max_message_mib, path
        assert cfg.federation.chunk_kib <= broker.chunk_kib, path
    assert len(models) == 3


def test_node_configs_are_the_three_zoo_models():
    from graft_fed.zoo import ZOO_NAMES

    models = {load_node_config(path).model.path for path in NODE_CONFIGS}
    assert models == {f"zoo:{name}" for name in ZOO_NAMES}, f"the zoo ships {ZOO_NAMES}"


def test_compose_runs_broker_and_three_nodes_with_existing_configs():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    services = compose["services"]
    assert "broker" in services
    nodes = [name for name in services if name != "broker"]
    assert len(nodes) == 3
    mounted = set()
    for name, svc in services.items():
        build = svc["build"]
        assert (DEPLOY / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).is_file()
        assert svc["networks"] == ["federation"]
        for vol in svc["volumes"]:
            src, dst, *_ = vol.split(":")
            if src.startswith("."):
                assert (DEPLOY / src).is_file(), f"{name}: {src} does not exist"
                assert dst == ("/etc/graft-fed/broker.yaml" if name == "broker" else "/etc/graft-fed/node.yaml")
                mounted.add((DEPLOY / src).resolve())
            else:
                assert src in compose["volumes"], f"{name}: named volume {src} is not declared"
                assert dst == "/var/lib/graft-fed"
        if name != "broker":
            assert svc["depends_on"]["broker"]["condition"] == "service_healthy"
    assert mounted == {p.resolve() for p in [CONFIGS / "broker.yaml", *NODE_CONFIGS]}
    assert set(compose["networks"]) == {"federation"}


def test_k8s_configmaps_embed_the_same_valid_configs():
    embedded: dict[str, str] = {}
    for cm in _by_kind("ConfigMap"):
        embedded.update(cm["data"])
    assert set(embedded) == {"broker.yaml"} | {p.name for p in NODE_CONFIGS}
    for key, text in embedded.items():
        data = yaml.safe_load(text)
        assert data == yaml.safe_load((CONFIGS / key).read_text(encoding="utf-8")), f"{key} differs from deploy/configs"
        if key == "broker.yaml":
            from_mapping(BrokerConfig, data)
        else:
            from_mapping(NodeConfig, data)


def test_k8s_broker_has_volume_service_probes_and_scrape_annotations():
    (dep,) = _by_kind("Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
    assert {p["containerPort"] for p in c["ports"]} == {50551, 9464}
    assert c["resources"]["requests"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    pvcs = {p["metadata"]["name"] for p in _by_kind("PersistentVolumeClaim")}
    assert claims and claims <= pvcs
    (svc,) = _by_kind("Service")
    assert svc["metadata"]["name"] == "broker"  # what the node configs dial
    assert {p["port"] for p in svc["spec"]["ports"]} == {50551, 9464}
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    ann = svc["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9464"


def test_k8s_nodes_are_jobs_one_per_node_config():
    jobs = _by_kind("Job")
    assert len(jobs) == len(NODE_CONFIGS)
    cm_keys = {k for cm in _by_kind("ConfigMap") for k in cm["data"]}
    pvcs = {p["metadata"]["name"] for p in _by_kind("PersistentVolumeClaim")}
    keys = set()
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] in ("OnFailure", "Never")
        (c,) = pod["containers"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert "--resume" in c["args"]
        for v in pod["volumes"]:
            if "configMap" in v:
                (item,) = v["configMap"]["items"]
                assert item["path"] == "node.yaml" and item["key"] in cm_keys
                keys.add(item["key"])
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs
        for init in pod.get("initContainers", []):
            compile(init["command"][-1], f"{job['metadata']['name']}:{init['name']}", "exec")
    assert keys == {p.name for p in NODE_CONFIGS}


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    listed = set(kust["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    assert {i["name"] for i in kust["images"]} == {"graft-fed-broker", "graft-fed-node"}


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics, enough for an allow-list: last match wins; a pattern
    also matches everything below a matched directory."""
    ignored = False
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        pat_re = fnmatch.translate(pat.replace("**/", "__ANY__/")).replace("__ANY__/", "(?:.*/)?")
        if any(re.match(pat_re, p) for p in prefixes):
            ignored = not neg
    return ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_existing_unignored_paths(dockerfile):
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} (BuildKit's per-Dockerfile ignore file) is missing"
    patterns = [ln.strip() for ln in ignore.read_text(encoding="utf-8").splitlines()
                if ln.strip() and not ln.startswith("#")]
    instr = _instructions(dockerfile)
    assert instr[0][0] in ("ARG", "FROM")
    assert any(w == "FROM" and "python:3.11-slim" in r for w, r in instr) or \
        any(w == "ARG" and r == "PYTHON_IMAGE=python:3.11-slim" for w, r in instr)
    copied = 0
    for word, rest in instr:
        if word not in ("COPY", "ADD"):
            continue
        args = shlex.split(rest)
        if any(a.startswith("--from") for a in args):
            continue
        for src in [a for a in args if not a.startswith("--")][:-1]:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such path in the repository"
            assert not _ignored(src, patterns), f"{dockerfile.name}: COPY {src} is excluded by {ignore.name}"
            copied += 1
    assert copied >= 3
    assert _ignored(".venv", patterns) and _ignored("runs", patterns) and _ignored("tests", patterns)
    # Non-root, the documented entrypoint, and the state volume.
    users = [r for w, r in instr if w == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    role = dockerfile.name.split(".")[-1]
    (entry,) = [r for w, r in instr if w == "ENTRYPOINT"]
    assert f'"graft-fed", "{role}", "--config", "/etc/graft-fed/{role}.yaml"' in entry
    assert any(w == "VOLUME" and "/var/lib/graft-fed" in r for w, r in instr)
    if role == "broker":
        (hc,) = [r for w, r in instr if w == "HEALTHCHECK"]
        assert "urllib" in hc and "HEALTHZ" in hc
        assert "download.pytorch.org/whl/cpu" in dockerfile.read_text(encoding="utf-8")
    else:
        assert any(w == "ARG" and r.startswith("TORCH=") for w, r in instr)


def test_dockerignore_semantics_used_above():
    pats = ["*", "!graft_fed", "**/__pycache__"]
    assert _ignored("tests", pats) and not _ignored("graft_fed", pats)
    assert not _ignored("graft_fed/zoo/models/x/config.json", pats)
    assert _ignored("graft_fed/zoo/__pycache__", pats)


def test_broker_and_node_images_pin_the_same_verifier_and_torch():
    # The math-verify version is part of the manifest: differing images would refuse each other.
    def args(path: Path) -> dict[str, str]:
        return dict(r.split("=", 1) for w, r in _instructions(path) if w == "ARG" and "=" in r)

    broker, node = (args(DOCKER / f"Dockerfile.{role}") for role in ("broker", "node"))
    for key in ("MATH_VERIFY_VERSION", "TORCH_VERSION", "PYTHON_IMAGE"):
        assert broker[key] == node[key], key
