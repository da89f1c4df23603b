"""The deploy files, proven without a cluster: every Kubernetes manifest against the
Kubernetes schemas (``kubernetes-validate``, strict: an unknown field is an error), the
compose file against the Compose Specification's JSON schema (vendored in ``schemas/``), and
every /metrics they serve opened to the network (the default binds 127.0.0.1)."""

from __future__ import annotations

import copy
import json
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
COMPOSE_SCHEMA = Path(__file__).parent / "schemas" / "compose-spec.json"
K8S_VERSIONS = ("1.30", "1.37")
"""The oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate knows."""

MANIFESTS = [
    pytest.param(doc, id=f"{path.name}:{doc['kind']}/{doc['metadata']['name']}")
    for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if doc
]


def k8s_validate(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@cache
def compose_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def compose_errors(doc: Any) -> list[str]:
    errors = compose_validator().iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]


def compose_file() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # type: ignore[no-any-return]


# -- Kubernetes -------------------------------------------------------------------------------
def test_there_are_manifests() -> None:
    kinds = sorted(p.values[0]["kind"] for p in MANIFESTS)  # type: ignore[index]
    assert kinds == ["Deployment", "Deployment", "Service"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", MANIFESTS)
def test_each_manifest_validates(doc: dict[str, Any], version: str) -> None:
    k8s_validate(doc, version)


def broker_deployment() -> dict[str, Any]:
    return copy.deepcopy(next(p.values[0] for p in MANIFESTS if "broker" in p.id and "Deployment" in p.id))  # type: ignore[index]


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d["spec"].update(replicas="one"),  # wrong type
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerport=5555),  # a typo
        lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),  # a required field
    ],
    ids=["wrong-type", "unknown-field", "missing-field"],
)
def test_a_broken_manifest_fails(breakage: Any) -> None:
    doc = broker_deployment()
    breakage(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(doc, K8S_VERSIONS[-1])


def test_an_unknown_kind_fails_rather_than_passing_unchecked() -> None:
    doc = broker_deployment()
    doc["kind"] = "Deploymnet"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        k8s_validate(doc, K8S_VERSIONS[-1])


# -- Compose ----------------------------------------------------------------------------------
def test_the_compose_file_validates_against_the_compose_spec() -> None:
    assert compose_errors(compose_file()) == []


@pytest.mark.parametrize(
    ("breakage", "where"),
    [
        (lambda d: d["services"]["broker"].update(comand=["broker"]), "services.broker"),  # a typo
        (lambda d: d["services"]["broker"].update(ports=5555), "services.broker.ports"),  # wrong type
        (lambda d: d.update(nmae="zmq-rollout"), "(top)"),
        (
            lambda d: d["services"]["worker"]["deploy"]["resources"]["reservations"].update(devices="gpu"),
            "services.worker.deploy.resources.reservations.devices",
        ),
    ],
    ids=["unknown-service-key", "ports-not-a-list", "unknown-top-level-key", "devices-not-a-list"],
)
def test_a_broken_compose_file_fails(breakage: Any, where: str) -> None:
    doc = compose_file()
    breakage(doc)
    errors = compose_errors(doc)
    assert any(e.startswith(where + ":") for e in errors), errors


def test_the_compose_file_uses_the_top_level_name_key() -> None:
    """The reason Debian's docker-compose 1.29 cannot check it (its schema rejects ``name``)."""
    assert compose_file()["name"] == "zmq-rollout"


# -- /metrics reachable from outside its container --------------------------------------------
def metrics_exposure_problems(args: list[str]) -> list[str]:
    """What is wrong with how a command line serves /metrics to Prometheus in another container."""
    if "--metrics-port" not in args:
        return []
    if "--metrics-host" not in args:
        return ["--metrics-port without --metrics-host: /metrics binds 127.0.0.1, unreachable from outside"]
    host = args[args.index("--metrics-host") + 1]
    return [] if host == "0.0.0.0" else [f"--metrics-host {host}: not every interface"]


def metrics_port(args: list[str]) -> int:
    return int(args[args.index("--metrics-port") + 1])


def test_the_exposure_check_can_fail() -> None:
    assert metrics_exposure_problems(["broker", "--metrics-port", "9100"])
    assert metrics_exposure_problems(["broker", "--metrics-port", "9100", "--metrics-host", "127.0.0.1"])
    assert not metrics_exposure_problems(["broker", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"])


def test_k8s_containers_serve_metrics_on_every_interface_at_the_annotated_port() -> None:
    seen = []
    for param in MANIFESTS:
        doc: dict[str, Any] = param.values[0]  # type: ignore[assignment]
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]
        for container in pod["spec"]["containers"]:
            args = [str(a) for a in container.get("args", [])]
            assert not metrics_exposure_problems(args), (param.id, container["name"])
            port = metrics_port(args)
            assert port in [p["containerPort"] for p in container["ports"]], (param.id, port)
            assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port), param.id
            seen.append(container["name"])
    assert sorted(seen) == ["broker", "worker"]


def test_compose_services_serve_metrics_where_prometheus_scrapes_them() -> None:
    services = compose_file()["services"]
    ports = {}
    for name, service in services.items():
        command = service.get("command", [])
        args = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        assert not metrics_exposure_problems(args), name
        if "--metrics-port" in args:
            ports[name] = metrics_port(args)
    assert ports == {"broker": 9100, "worker": 9200}
    assert "9100:9100" in services["broker"]["ports"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job.get("static_configs", []) for t in c["targets"]}
    assert targets == {f"{name}:{port}" for name, port in ports.items()}


def test_docker_run_examples_open_metrics_too() -> None:
    """The ``docker run`` lines in deploy/README.md and the Dockerfile's header, as people copy them."""
    lines = [
        line.lstrip("# ").rstrip("\\ ")
        for path in (DEPLOY / "README.md", DEPLOY / "compose" / "Dockerfile")
        for line in path.read_text().replace("\\\n", " ").splitlines()
        if "docker run" in line and "--metrics-port" in line
    ]
    assert len(lines) >= 3
    for line in lines:
        args = shlex.split(line)
        assert not metrics_exposure_problems(args), line
