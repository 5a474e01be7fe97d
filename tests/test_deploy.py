"""deploy/: every YAML parses, every config in it is a valid broker/node config, the compose
file, the Kubernetes manifests and the Dockerfiles point at things that exist, and the node
configs match the broker's manifest (a mismatching node would be refused at Join).

Transport security: no deploy config would be refused at start (each has TLS files, or
`insecure: true`), the demo uses mutual TLS with certificates named as the node ids, and
the compose mounts and Kubernetes volumes provide exactly the certificate files the configs
reference, as deploy/certs.sh names them.

Static checks (no Docker, no cluster), plus one loopback mutual-TLS handshake with
certificates from deploy/certs.sh: fast, and run everywhere."""

from __future__ import annotations

import fnmatch
import functools
import os
import posixpath
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from graft_fed.broker.config import BrokerConfig, load_broker_config
from graft_fed.configbase import from_mapping
from graft_fed.federation.transport import check_plaintext, is_loopback
from graft_fed.node.node import NodeConfig, load_node_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CONFIGS = DEPLOY / "configs"
K8S = DEPLOY / "k8s"
DOCKER = DEPLOY / "docker"
NODE_CONFIGS = sorted(CONFIGS.glob("node-*.yaml"))
INSECURE = CONFIGS / "insecure"
CERTS_IN_CONTAINER = "/etc/graft-fed/certs"
TLS_BROKER_KEYS = ("tls_cert", "tls_key", "client_ca")
TLS_NODE_KEYS = ("tls_ca", "tls_cert", "tls_key")


class _ComposeLoader(yaml.SafeLoader):
    """YAML plus Docker Compose's merge tags (!override, !reset): the tagged value as is."""


_ComposeLoader.add_constructor("!override", lambda loader, node: (
    loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode)
    else loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode)
    else loader.construct_scalar(node)))
_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def _load_yaml_all(path: Path) -> list:
    return list(yaml.load_all(path.read_text(encoding="utf-8"), Loader=_ComposeLoader))
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
        docs = _load_yaml_all(path)
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
        assert cfg.run.prompt_schedule_seed == broker.seed, path  # the shared prompt schedule
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


def _mounts(svc: dict) -> list[tuple[str, str, str]]:
    """A compose service's volumes as (type, source, target), short and long syntax."""
    out = []
    for vol in svc["volumes"]:
        if isinstance(vol, dict):
            out.append((vol["type"], vol.get("source", ""), vol["target"]))
        else:
            src, dst, *_ = vol.split(":")
            out.append(("bind" if src.startswith((".", "/")) else "volume", src, dst))
    return out


def _compose(name: str = "compose.yaml") -> dict:
    (doc,) = _load_yaml_all(DEPLOY / name)
    return doc


def test_compose_runs_broker_and_three_nodes_with_existing_configs():
    compose = _compose()
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
        for kind, src, dst in _mounts(svc):
            if kind == "bind" and dst.startswith(CERTS_IN_CONTAINER + "/"):
                continue  # certificates: deploy/certs/ is generated, see the TLS tests below
            if kind == "bind":
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
            for src in v.get("projected", {}).get("sources", []):
                if "configMap" in src:
                    (item,) = src["configMap"]["items"]
                    assert item["path"] == "node.yaml" and item["key"] in cm_keys
                    keys.add(item["key"])
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs
        for init in pod.get("initContainers", []):
            compile(init["command"][-1], f"{job['metadata']['name']}:{init['name']}", "exec")
            # A plain TCP check: it needs no credentials, so it works against the TLS broker.
            assert "insecure_channel" not in init["command"][-1]
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


# ---- transport security -------------------------------------------------------------------------


def _all_configs() -> list[tuple[str, str, dict]]:
    """(where, role, mapping) for every config deploy/ ships: deploy/configs/, its insecure/
    variants and the copies embedded in the Kubernetes ConfigMaps."""
    out = []
    for path in sorted(CONFIGS.glob("*.yaml")) + sorted(INSECURE.glob("*.yaml")):
        role = "broker" if path.name == "broker.yaml" else "node"
        out.append((str(path.relative_to(DEPLOY)), role, yaml.safe_load(path.read_text(encoding="utf-8"))))
    for cm in _by_kind("ConfigMap"):
        for key, text in cm["data"].items():
            out.append((f"k8s:{cm['metadata']['name']}/{key}", "broker" if key == "broker.yaml" else "node",
                        yaml.safe_load(text)))
    return out


def _tls_paths(role: str, data: dict) -> set[str]:
    """The certificate files a config makes its process read."""
    section = data if role == "broker" else data.get("federation", {})
    return {section[k] for k in (TLS_BROKER_KEYS if role == "broker" else TLS_NODE_KEYS) if section.get(k)}


def test_no_deploy_config_would_be_refused_at_start():
    # Off loopback, plaintext gRPC is a ConfigError at start unless `insecure: true`.
    configs = _all_configs()
    assert len(configs) >= 2 * (1 + len(NODE_CONFIGS)) + 1 + len(NODE_CONFIGS)
    for where, role, data in configs:
        if role == "broker":
            cfg = from_mapping(BrokerConfig, data)
            address, tls, insecure = cfg.listen, cfg.tls_cert is not None, cfg.insecure
        else:
            cfg = from_mapping(NodeConfig, data)
            f = cfg.federation
            address, tls, insecure = f.broker, f.tls_ca is not None, f.insecure
        assert tls or insecure or is_loopback(address), f"{where}: plaintext on {address} would be refused"
        if not tls:
            check_plaintext(address, insecure, where)  # raises ConfigError where the process would
        if tls:
            assert not insecure, f"{where}: TLS and insecure together: drop insecure"


def test_demo_configs_use_mutual_tls_with_certificates_named_as_the_node_ids():
    broker = load_broker_config(CONFIGS / "broker.yaml")
    assert not broker.insecure
    assert broker.tls_cert == f"{CERTS_IN_CONTAINER}/broker.pem"
    assert broker.tls_key == f"{CERTS_IN_CONTAINER}/broker.key"
    assert broker.client_ca == f"{CERTS_IN_CONTAINER}/ca.pem", "the demo is mutual TLS: nodes are identified"
    for path in NODE_CONFIGS:
        f = load_node_config(path).federation
        assert not f.insecure, path
        assert f.tls_ca == broker.client_ca, path
        # The broker takes a node's identity from its certificate's name: it must be the node id.
        assert f.tls_cert == f"{CERTS_IN_CONTAINER}/{f.node_id}.pem", path
        assert f.tls_key == f"{CERTS_IN_CONTAINER}/{f.node_id}.key", path
        # The broker certificate's hosts (deploy/certs.sh) must cover the address nodes dial.
        assert f.broker.rsplit(":", 1)[0] in _certs_sh_broker_hosts(), path


def _certs_sh_broker_hosts() -> list[str]:
    m = re.search(r'BROKER_HOSTS="\$\{BROKER_HOSTS:-([^}]*)\}"', (DEPLOY / "certs.sh").read_text(encoding="utf-8"))
    assert m, "deploy/certs.sh sets BROKER_HOSTS"
    return m.group(1).split(",")


def test_insecure_variants_are_the_demo_configs_in_plaintext_and_say_so():
    assert sorted(p.name for p in INSECURE.glob("*.yaml")) == sorted(["broker.yaml", *(p.name for p in NODE_CONFIGS)])
    for path in sorted(INSECURE.glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        assert "INSECURE" in text and "PLAINTEXT" in text, f"{path.name}: say loudly that it is plaintext"
        insecure, secure = yaml.safe_load(text), yaml.safe_load((CONFIGS / path.name).read_text(encoding="utf-8"))
        if path.name == "broker.yaml":
            a, b, keys = insecure, secure, TLS_BROKER_KEYS + ("allowlist",)
        else:
            a, b, keys = insecure["federation"], secure["federation"], TLS_NODE_KEYS
        assert a.pop("insecure") is True, path.name
        assert not any(a.get(k) for k in keys), f"{path.name}: no TLS files in the plaintext variant"
        for k in keys:
            b.pop(k, None)
        assert insecure == secure, f"{path.name}: differs from deploy/configs/{path.name} beyond transport"


def _certs_sh_names() -> set[str]:
    """The files deploy/certs.sh produces for the demo (`graft-fed certs` naming)."""
    names = {"ca.pem", "broker.pem", "broker.key"}
    for path in NODE_CONFIGS:  # certs.sh issues one per deploy/configs/node-<node_id>.yaml
        node_id = load_node_config(path).node_id
        names |= {f"{node_id}.pem", f"{node_id}.key"}
    return names


def test_compose_mounts_every_certificate_the_configs_reference_and_nothing_more():
    services = _compose()["services"]
    produced = _certs_sh_names()
    for name, svc in services.items():
        binds = {dst: src for kind, src, dst in _mounts(svc) if kind == "bind"}
        config = binds["/etc/graft-fed/broker.yaml" if name == "broker" else "/etc/graft-fed/node.yaml"]
        role = "broker" if name == "broker" else "node"
        wanted = _tls_paths(role, yaml.safe_load((DEPLOY / config).read_text(encoding="utf-8")))
        assert len(wanted) == 3, f"{name}: the demo is mutual TLS"
        certs = {dst: src for dst, src in binds.items() if dst.startswith(CERTS_IN_CONTAINER + "/")}
        assert set(certs) == wanted, f"{name}: mounts {sorted(certs)}, the config reads {sorted(wanted)}"
        for dst, src in certs.items():
            assert posixpath.normpath(src) == f"certs/{posixpath.basename(dst)}", f"{name}: {src} -> {dst}"
            assert posixpath.basename(dst) in produced, f"{name}: deploy/certs.sh does not produce {src}"
        for vol in svc["volumes"]:
            if isinstance(vol, dict) and vol["target"] in certs:
                assert vol.get("read_only") is True, f"{name}: mount {vol['target']} read-only"
                # Fail clearly when deploy/certs.sh has not run, instead of creating directories.
                assert vol.get("bind", {}).get("create_host_path") is False, name
    # The CA key stays with the operator.
    assert not any("ca.key" in str(v) for svc in services.values() for v in svc["volumes"])


def test_compose_insecure_override_swaps_in_the_plaintext_configs():
    base, over = _compose()["services"], _compose("compose.insecure.yaml")["services"]
    assert set(over) == set(base)
    for name, svc in over.items():
        mounts = _mounts(svc)
        assert not any(dst.startswith(CERTS_IN_CONTAINER) for _, _, dst in mounts), name
        (config,) = [src for kind, src, dst in mounts if kind == "bind"]
        base_config = next(src for kind, src, dst in _mounts(base[name]) if dst.endswith(".yaml"))
        assert posixpath.normpath(config) == posixpath.normpath(base_config).replace("configs/", "configs/insecure/")
        assert (DEPLOY / config).is_file()
        # Volumes replaced wholesale (!override): the state volume must still be there.
        assert {(k, s, d) for k, s, d in _mounts(base[name]) if k == "volume"} <= set(mounts), name


def _pod_files(pod: dict, container: dict) -> dict[str, tuple[str, str]]:
    """Files a container sees from ConfigMap/Secret volumes: path -> (kind/name, key)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    files: dict[str, tuple[str, str]] = {}
    for mount in container.get("volumeMounts", []):
        vol = volumes[mount["name"]]
        sources = vol["projected"]["sources"] if "projected" in vol else [vol]
        for src in sources:
            for kind in ("configMap", "secret"):
                if kind in src:
                    ref = src[kind].get("name") or src[kind].get("secretName")
                    for item in src[kind]["items"]:
                        files[posixpath.join(mount["mountPath"], item["path"])] = (f"{kind}/{ref}", item["key"])
    return files


def test_k8s_pods_mount_every_certificate_the_configs_reference_from_their_secret():
    embedded = {k: yaml.safe_load(v) for cm in _by_kind("ConfigMap") for k, v in cm["data"].items()}
    produced = _certs_sh_names()
    pods = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in _by_kind("Deployment") + _by_kind("Job")]
    assert len(pods) == 1 + len(NODE_CONFIGS)
    for name, pod in pods:
        (c,) = pod["containers"]
        files = _pod_files(pod, c)
        role = "broker" if c["name"] == "broker" else "node"
        (_, key) = files[f"/etc/graft-fed/{role}.yaml"]
        data = embedded[key]
        wanted = _tls_paths(role, data)
        assert len(wanted) == 3, f"{name}: the demo is mutual TLS"
        secret = "graft-fed-broker-tls" if role == "broker" else f"graft-fed-node-{data['federation']['node_id']}-tls"
        for path in wanted:
            assert path in files, f"{name}: {path} is referenced by {key} but not mounted"
            assert files[path] == (f"secret/{secret}", posixpath.basename(path)), f"{name}: {path}"
            assert posixpath.basename(path) in produced
        secret_files = {p for p, (ref, _) in files.items() if ref.startswith("secret/")}
        assert secret_files == wanted, f"{name}: mount only what the config reads"
        assert not any(k == "ca.key" for _, k in files.values()), "the CA key stays with the operator"
        # Keys readable by the image's user through fsGroup, not by everyone.
        for v in pod["volumes"]:
            if "projected" in v:
                assert v["projected"]["defaultMode"] & 0o007 == 0, f"{name}: {v['name']} is world-readable"
        assert pod["securityContext"]["fsGroup"] == 10001
    # The init step waits with a plain TCP connect: no credentials needed.
    for job in _by_kind("Job"):
        for init in job["spec"]["template"]["spec"].get("initContainers", []):
            assert "socket.create_connection" in init["command"][-1]


def test_certs_sh_issues_the_demo_certificates_and_they_carry_mutual_tls(tmp_path):
    """deploy/certs.sh end to end, then one mutual-TLS call with the demo configs' files."""
    graft_fed = shutil.which("graft-fed", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                 os.environ.get("PATH", "")]))
    if graft_fed is None or shutil.which("bash") is None:
        pytest.skip("needs bash and the graft-fed command")
    certs = tmp_path / "certs"
    env = {**os.environ, "CERTS_DIR": str(certs), "GRAFT_FED": graft_fed}
    subprocess.run(["bash", str(DEPLOY / "certs.sh")], env=env, check=True, capture_output=True, timeout=120)
    assert {p.name for p in certs.iterdir()} >= _certs_sh_names() | {"ca.key"}
    assert stat.S_IMODE((certs / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    # Rerunning keeps what exists (and the CA).
    ca = (certs / "ca.pem").read_bytes()
    subprocess.run(["bash", str(DEPLOY / "certs.sh")], env=env, check=True, capture_output=True, timeout=120)
    assert (certs / "ca.pem").read_bytes() == ca

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    broker_cert = x509.load_pem_x509_certificate((certs / "broker.pem").read_bytes())
    sans = broker_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"broker", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    for path in NODE_CONFIGS:
        node_id = load_node_config(path).node_id
        cert = x509.load_pem_x509_certificate((certs / f"{node_id}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node_id

    # The demo configs, with /etc/graft-fed/certs/ pointed at these files, on loopback.
    from graft_fed.broker.server import BrokerServer
    from graft_fed.node.client import BrokerClient

    def here(p: str) -> str:
        return str(certs / posixpath.basename(p)) if p and p.startswith(CERTS_IN_CONTAINER + "/") else p

    data = yaml.safe_load((CONFIGS / "broker.yaml").read_text(encoding="utf-8"))
    data.update({k: here(data[k]) for k in TLS_BROKER_KEYS}, listen="127.0.0.1:0", http="", db=":memory:")
    server = BrokerServer(from_mapping(BrokerConfig, data)).start()
    try:
        f = load_node_config(NODE_CONFIGS[0]).federation
        client = BrokerClient(f"localhost:{server.port}", f.node_id, tls_ca=here(f.tls_ca), tls_cert=here(f.tls_cert),
                              tls_key=here(f.tls_key), rpc_timeout_s=10)
        try:
            assert client.status().manifest.federation_id == data["federation_id"]
        finally:
            client.close()
    finally:
        server.stop(0)


@pytest.mark.parametrize("path", NODE_CONFIGS, ids=lambda p: p.stem)
def test_demo_node_configs_improve_rather_than_wreck_their_models(path, tmp_path):
    """The demo's training settings, run for two steps on this machine (no broker: the
    federation section only decides where groups come from, not the update). A learning
    rate ten times too high took held-out pass@1 from ~0.5 to under 0.1 in two steps; the
    held-out set is cut to 16 prompts per family to keep the suite short."""
    import json

    from graft_fed.cli import main

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.pop("federation")
    data["run"].update(output_dir=str(tmp_path / "run"), steps=2, device="cpu", threads=1,
                       checkpoint_every=0, eval_every=0)
    data["eval"]["data"]["per_family"] = 16
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert main(["train", "--config", str(cfg), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    before, after = summary["eval_before"]["pass@1"], summary["eval_after"]["pass@1"]
    assert before > 0.3, f"{path.name}: the zoo model should start near 0.5, got {before:.3f}"
    assert after >= before - 0.15, f"{path.name}: held-out pass@1 collapsed {before:.3f} -> {after:.3f}"
