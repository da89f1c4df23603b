"""The deploy files, proven without a cluster: every Kubernetes manifest against the
Kubernetes schemas (``kubernetes-validate``, strict: an unknown field is an error), the
compose file against the Compose Specification's JSON schema (vendored in ``schemas/``),
every /metrics they serve opened to the network (the default binds 127.0.0.1), every file
they mount present, and Prometheus and Grafana wired to each other the same way in both."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import re
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
GRAFANA = DEPLOY / "grafana"
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
    # Grafana: its Deployment and Service, and ConfigMaps: data source, provider, 4 dashboards.
    assert kinds == ["ConfigMap"] * 6 + ["Deployment"] * 3 + ["Service"] * 2


def manifests(kind: str) -> dict[str, dict[str, Any]]:
    docs = [p.values[0] for p in MANIFESTS]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}  # type: ignore[index]


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
            if "prometheus.io/scrape" not in pod["metadata"].get("annotations", {}):
                assert "--metrics-port" not in args, (param.id, "serves /metrics that nothing scrapes")
                continue
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


# -- mounts: what the containers read is in the repository, where they look for it ----------
def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A compose service's bind mounts of repository files: container path -> host path."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):  # not a named volume, not ${MODEL_DIR}
            mounts[target] = (COMPOSE.parent / source).resolve()
    return mounts


def test_every_file_the_compose_file_mounts_exists() -> None:
    services = compose_file()["services"]
    mounted = {f"{name}:{target}": source for name, s in services.items() for target, source in bind_mounts(s).items()}
    assert len(mounted) == 5, mounted  # prometheus: 2, grafana: 3 (the worker's model comes from ${MODEL_DIR})
    missing = [f"{where} <- {source}" for where, source in mounted.items() if not source.exists()]
    assert not missing, f"the compose file mounts files that are not in the repository: {missing}"


def test_the_mount_check_can_fail() -> None:
    service = {"volumes": ["../prometheus/nope.yml:/etc/prometheus/nope.yml:ro", "data:/data", "${X}:/x"]}
    assert list(bind_mounts(service)) == ["/etc/prometheus/nope.yml"]
    assert not bind_mounts(service)["/etc/prometheus/nope.yml"].exists()


def test_prometheus_in_compose_finds_its_config_and_every_rule_file() -> None:
    """``rule_files`` are relative to the config file: each must be mounted beside it."""
    service = compose_file()["services"]["prometheus"]
    mounts = bind_mounts(service)
    config = next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--config.file="))
    assert mounts[config] == DEPLOY / "prometheus" / "prometheus.yml"
    rule_files = yaml.safe_load(mounts[config].read_text())["rule_files"]
    assert rule_files
    for rule_file in rule_files:
        in_container = str(Path(config).parent / rule_file)
        assert in_container in mounts, f"{rule_file} (at {in_container} in the container) is not mounted"
        assert mounts[in_container] == mounts[config].parent / rule_file


# -- Grafana: data source, provider, dashboards, the same in compose and on Kubernetes -------
def grafana_container() -> dict[str, Any]:
    container: dict[str, Any] = manifests("Deployment")["zmq-rollout-grafana"]["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


def grafana_k8s_mounts() -> dict[str, str]:
    """Container path -> the volume's name, in the Grafana pod."""
    return {m["mountPath"]: m["name"] for m in grafana_container()["volumeMounts"]}


def provider_path() -> str:
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "zmq-rollout.yml").read_text())
    path: str = provider["providers"][0]["options"]["path"]
    return path


def test_grafana_finds_the_provisioning_and_the_dashboards_in_compose() -> None:
    mounts = bind_mounts(compose_file()["services"]["grafana"])
    assert mounts["/etc/grafana/provisioning/datasources"] == GRAFANA / "provisioning" / "datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == GRAFANA / "provisioning" / "dashboards"
    assert mounts[provider_path()] == GRAFANA / "dashboards"
    assert all(v.endswith(":ro") for v in compose_file()["services"]["grafana"]["volumes"])


def test_grafana_finds_the_provisioning_and_the_dashboards_on_kubernetes() -> None:
    mounts = grafana_k8s_mounts()
    assert mounts["/etc/grafana/provisioning/datasources"] == "datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == "dashboard-providers"
    assert mounts[provider_path()] == "dashboards"
    volumes = {
        v["name"]: v for v in manifests("Deployment")["zmq-rollout-grafana"]["spec"]["template"]["spec"]["volumes"]
    }
    config_maps = manifests("ConfigMap")
    assert "prometheus.yml" in config_maps[volumes["datasources"]["configMap"]["name"]]["data"]
    assert "zmq-rollout.yml" in config_maps[volumes["dashboard-providers"]["configMap"]["name"]]["data"]
    projected = [s["configMap"]["name"] for s in volumes["dashboards"]["projected"]["sources"]]
    in_the_volume = sorted(key for name in projected for key in config_maps[name]["data"])
    assert in_the_volume == sorted(p.name for p in (GRAFANA / "dashboards").glob("*.json"))
    holding_dashboards = {n for n, c in config_maps.items() if any(k.endswith(".json") for k in c["data"])}
    assert holding_dashboards == set(projected), "a dashboard ConfigMap that the Grafana pod does not mount"


def grafana_settings() -> list[dict[str, str]]:
    compose = compose_file()["services"]["grafana"]["environment"]
    k8s = {e["name"]: e["value"] for e in grafana_container()["env"] if "value" in e}
    return [compose, k8s]


def test_grafana_shows_the_dashboards_to_anonymous_viewers_from_the_fleet_home() -> None:
    for env in grafana_settings():
        assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
        assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
        home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
        assert str(home.parent) == provider_path()
        assert (GRAFANA / "dashboards" / home.name).is_file(), home


def test_grafana_is_pinned_to_the_version_the_dashboards_are_built_for() -> None:
    images = {compose_file()["services"]["grafana"]["image"], grafana_container()["image"]}
    assert len(images) == 1, images
    image = images.pop()
    assert re.fullmatch(r"grafana/grafana-oss:\d+\.\d+\.\d+", image), image
    sdk = importlib.metadata.version("grafana-foundation-sdk").split("!")[-1]  # "EPOCH!11.6.0"
    assert image.split(":")[1].split(".")[:2] == sdk.split(".")[:2], (image, sdk)
    assert "3000:3000" in compose_file()["services"]["grafana"]["ports"]
    service = manifests("Service")["zmq-rollout-grafana"]
    assert [p["port"] for p in service["spec"]["ports"]] == [3000]


def test_the_datasource_is_the_compose_prometheus_scraping_as_often_as_grafana_assumes() -> None:
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    [source] = datasource["datasources"]
    assert source["type"] == "prometheus" and source["uid"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"]).groups()  # type: ignore[union-attr]
    services = compose_file()["services"]
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services[host]["command"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert source["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]
