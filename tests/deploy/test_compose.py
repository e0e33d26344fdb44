"""compose.yaml and everything it builds and mounts, checked without a Docker engine.

No Docker engine runs on the project's machines, so these tests check what `docker compose up`
would trip over: the Compose specification, the paths it builds from and mounts, the `hmakv`
subcommand and environment each service runs with (through the real CLI parser), ports,
start-up order and health checks, Kafka's listeners, the image's build context (installed
here exactly as the Dockerfile installs it), and that the bridge, Prometheus and Grafana point
at the services compose defines. The Prometheus file on its own: test_prometheus_config.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from hmakv.bridge.config import load_engines_file
from hmakv.cli import build_parser
from hmakv.kafka.jars import kafka_version
from hmakv.kafka.process import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
# The Compose Specification's schema: CI has it next to the checkout; it is not copied in here.
COMPOSE_SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"
DOCKERIGNORE = REPO / ".dockerignore"
PACKAGES = ("producer", "kvlog", "bridge", "consumers", "hmakv")
# hmakv/<name> links to the top-level package <name>: the repository's layout, one namespace.
LINKED = {(name,) for name in PACKAGES if name != "hmakv"}

# Subcommands that serve Prometheus /metrics, scraped as job "hmakv-<subcommand>".
METRICS_SUBCOMMANDS = ("bridge", "index")
# What compose's health check asks each long-running subcommand (GET, 200 = healthy).
HEALTH_PATHS = {"bridge": "/healthz", "index": "/healthz", "engine": "/v1/status"}
# JSON Schema drafts by the marker in a schema's "$schema".
SCHEMA_DRAFTS: dict[str, type[Any]] = {
    "draft-07": jsonschema.Draft7Validator,
    "2019-09": jsonschema.Draft201909Validator,
    "2020-12": jsonschema.Draft202012Validator,
}

_ENV_NAME = re.compile(r"\bHMAKV_[A-Z0-9_]+\b")
_INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")
# A bind address in a service's own configuration: "0.0.0.0:8181", "tcp://*:5557", "[::]:80".
_LISTEN_VALUE = re.compile(r"^(?:tcp://)?(?:\*|0\.0\.0\.0|\[::\]):(?P<port>\d+)$")
_PROBE_URL = re.compile(r"http://127\.0\.0\.1:(?P<port>\d+)(?P<path>/[\w/-]*)")


def interpolate(value: Any, environ: Mapping[str, str]) -> Any:
    """Compose's ``${VAR}`` and ``${VAR:-default}``, the only forms compose.yaml may use."""
    if isinstance(value, dict):
        return {key: interpolate(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, environ) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        given = environ.get(match["name"], "")
        return given if given else (match["default"] or "")

    result = _INTERPOLATION.sub(substitute, value)
    assert "$" not in result.replace("$$", ""), f"unsupported interpolation in {value!r}"
    return result.replace("$$", "$")


def load_compose() -> dict[str, Any]:
    """compose.yaml as `docker compose` sees it with no variables set: every default applies."""
    loaded: dict[str, Any] = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), {})
    return loaded


COMPOSE = load_compose()
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
# The services built from this repository's Dockerfile, i.e. running the hmakv command.
HMAKV_SERVICES = sorted(name for name, service in SERVICES.items() if "build" in service)


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def command_of(service: Mapping[str, Any]) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else [str(arg) for arg in command]


def subcommand_of(name: str) -> str:
    command = command_of(SERVICES[name])
    assert command, f"service {name} runs the image's default command, not a service"
    return command[0]


@dataclass(frozen=True)
class BindMount:
    source: Path
    target: PurePosixPath
    read_only: bool


def bind_mounts(service: Mapping[str, Any]) -> list[BindMount]:
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *options = volume.split(":")
            if not source.startswith((".", "/")):
                continue  # a named volume
            read_only = "ro" in options
        else:
            if volume.get("type") != "bind":
                continue
            source, target = volume["source"], volume["target"]
            read_only = bool(volume.get("read_only", False))
        mounts.append(BindMount((REPO / source).resolve(), PurePosixPath(target), read_only))
    return mounts


def named_volumes(service: Mapping[str, Any]) -> list[str]:
    names = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source = volume.split(":")[0]
            if ":" in volume and not source.startswith((".", "/")):
                names.append(source)
        elif volume.get("type") == "volume":
            names.append(volume["source"])
    return names


def host_path(service: Mapping[str, Any], container_path: str) -> Path | None:
    """Where a path inside the container comes from in the repository, through a bind mount."""
    path = PurePosixPath(container_path)
    for mount in bind_mounts(service):
        if path == mount.target or mount.target in path.parents:
            return mount.source / path.relative_to(mount.target)
    return None


def listen_ports(service: Mapping[str, Any]) -> list[int]:
    """The ports the service's process binds, as its own configuration says."""
    env = service_env(service)
    ports = [int(m["port"]) for v in env.values() if (m := _LISTEN_VALUE.match(v))]
    for listener in filter(None, env.get("KAFKA_LISTENERS", "").split(",")):
        ports.append(int(listener.rsplit(":", 1)[1]))
    if "GF_SERVER_HTTP_PORT" in env:
        ports.append(int(env["GF_SERVER_HTTP_PORT"]))
    for arg in command_of(service):
        if arg.startswith("--web.listen-address="):
            ports.append(int(arg.rsplit(":", 1)[1]))
    return ports


@dataclass(frozen=True)
class PublishedPort:
    host_ip: str
    published: int
    target: int


def published_ports(service: Mapping[str, Any]) -> list[PublishedPort]:
    result = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            result.append(
                PublishedPort(
                    port.get("host_ip", "0.0.0.0"),
                    int(port["published"]),
                    int(port["target"]),
                )
            )
            continue
        parts = str(port).split("/")[0].split(":")
        assert len(parts) in (2, 3), f"publish a host port explicitly: {port!r}"
        host_ip = parts[0] if len(parts) == 3 else "0.0.0.0"
        result.append(PublishedPort(host_ip, int(parts[-2]), int(parts[-1])))
    return result


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("hmakv's parser has no subcommands")


def healthcheck_test(service: Mapping[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    return [test] if isinstance(test, str) else [str(part) for part in test]


def load_yaml(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


# --- the Compose specification and the files compose refers to ---


def test_compose_file_matches_the_compose_specification() -> None:
    if not COMPOSE_SCHEMA.is_file():
        pytest.skip(
            f"the Compose schema is not at {COMPOSE_SCHEMA} (CI has it there; a plain clone "
            "does not): compose.yaml was not validated"
        )
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    declared = schema.get("$schema", "")
    drafts = [cls for marker, cls in SCHEMA_DRAFTS.items() if marker in declared]
    assert len(drafts) == 1, f"the Compose schema declares an unknown draft: {declared!r}"
    validator_class = drafts[0]
    validator_class.check_schema(schema)
    errors = [
        f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in validator_class(schema).iter_errors(COMPOSE)
    ]
    assert errors == []


def test_build_contexts_dockerfiles_and_bind_mounts_exist() -> None:
    for name, service in SERVICES.items():
        if "build" in service:
            context = REPO / service["build"]["context"]
            assert context.resolve() == REPO, f"{name}: build context must be the repo root"
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for mount in bind_mounts(service):
            assert mount.source.exists(), f"{name} mounts {mount.source}, which is missing"
            assert REPO in mount.source.parents, f"{name} mounts {mount.source} from outside"
            assert mount.read_only, f"{name} mounts {mount.source} writable"


def test_container_paths_in_the_environment_come_from_bind_mounts() -> None:
    for name, service in SERVICES.items():
        for key, value in service_env(service).items():
            if key.startswith("HMAKV_") and value.startswith("/"):
                source = host_path(service, value)
                assert source is not None, f"{name}: {key}={value} is not mounted from the repo"
                assert source.is_file(), f"{name}: {key}={value} is {source}, which is missing"


def test_named_volumes_are_declared_and_used() -> None:
    used = {volume for service in SERVICES.values() for volume in named_volumes(service)}
    assert used == set(COMPOSE.get("volumes", {}))
    assert {"kafka-data", "prometheus-data", "grafana-data"} <= used


# --- the hmakv command each service runs ---


def test_every_hmakv_service_runs_a_known_subcommand() -> None:
    known = set(subparsers(build_parser()))
    assert {"engine", "bridge", "index"} <= {subcommand_of(name) for name in HMAKV_SERVICES}
    for name in HMAKV_SERVICES:
        subcommand = subcommand_of(name)
        assert subcommand in known, f"service {name} runs `hmakv {subcommand}`, which hmakv lacks"


def container_environ(service: Mapping[str, Any]) -> dict[str, str]:
    """The service's environment, container paths replaced by the repository files mounted there
    and nothing of this process's own environment."""
    env = {}
    for key, value in service_env(service).items():
        mounted = host_path(service, value) if value.startswith("/") else None
        env[key] = str(mounted) if mounted else value
    return env


def parse_service_command(
    service: Mapping[str, Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The real hmakv parser, and what it makes of a service's command in its container
    environment (os.environ holds only that meanwhile: ConfigArgParse reads that object)."""
    parser = build_parser()
    with monkeypatch.context() as patch:
        for key in list(os.environ):
            patch.delenv(key)
        for key, value in container_environ(service).items():
            patch.setenv(key, value)
        try:
            args = parser.parse_args(command_of(service))
        except SystemExit as exit_:
            pytest.fail(
                f"`hmakv {' '.join(command_of(service))}` exits {exit_.code} (stderr above)"
            )
    return parser, args


@pytest.mark.parametrize("name", HMAKV_SERVICES)
def test_hmakv_service_environment_is_what_the_cli_reads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real parser accepts the service's command in the service's environment, and reads
    every HMAKV_* variable the service sets: the variables --help names are those it reads (a
    subcommand's, once it has parsed a command line)."""
    service = SERVICES[name]
    settings = {key for key in service_env(service) if key.startswith("HMAKV_")}
    parser, _ = parse_service_command(service, monkeypatch)
    subcommand = subcommand_of(name)
    understood = set(_ENV_NAME.findall(parser.format_help()))
    understood |= set(_ENV_NAME.findall(subparsers(parser)[subcommand].format_help()))
    unknown = sorted(settings - understood)
    assert unknown == [], f"{name} sets variables `hmakv {subcommand}` ignores: {unknown}"


def test_every_service_restarts_and_hmakv_services_run_under_init() -> None:
    for name, service in SERVICES.items():
        assert service.get("restart") == "unless-stopped", name
    for name in HMAKV_SERVICES:
        assert SERVICES[name].get("init") is True, f"{name}: PID 1 must forward SIGTERM"


# --- ports ---


def test_published_host_ports_are_unique_loopback_and_reach_a_listener() -> None:
    published = [(name, port) for name, s in SERVICES.items() for port in published_ports(s)]
    counts = Counter(port.published for _, port in published)
    assert [p for p, n in counts.items() if n > 1] == []
    for name, port in published:
        assert port.host_ip == "127.0.0.1", f"{name} publishes {port.published} beyond loopback"
        assert port.target in listen_ports(SERVICES[name]), (
            f"{name} publishes container port {port.target}, where nothing listens"
        )


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_ports_within_a_service_do_not_collide(name: str) -> None:
    ports = listen_ports(SERVICES[name])
    assert ports, f"{name}: no listen port found in its configuration"
    assert len(ports) == len(set(ports)), f"{name} binds one port twice: {sorted(ports)}"


# --- start-up order and health ---


def test_depends_on_targets_exist_and_wait_for_health_where_there_is_a_healthcheck() -> None:
    for name, service in SERVICES.items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: use depends_on with conditions"
        for target, spec in depends_on.items():
            assert target in SERVICES, f"{name} depends on {target}, which is not a service"
            expected = "service_healthy" if "healthcheck" in SERVICES[target] else "service_started"
            assert spec.get("condition") == expected, f"{name} -> {target}"


def test_services_that_need_kafka_wait_for_a_healthy_broker() -> None:
    for name in HMAKV_SERVICES:
        if "HMAKV_KAFKA_BOOTSTRAP" in service_env(SERVICES[name]):
            assert SERVICES[name]["depends_on"]["kafka"]["condition"] == "service_healthy"


@pytest.mark.parametrize("subcommand", sorted(HEALTH_PATHS))
def test_hmakv_services_are_probed_on_their_own_listen_port(subcommand: str) -> None:
    names = [name for name in HMAKV_SERVICES if subcommand_of(name) == subcommand]
    assert names, f"no service runs `hmakv {subcommand}`"
    for name in names:
        service = SERVICES[name]
        test = healthcheck_test(service)
        # Slim Python images have no curl or wget: the probe is the image's own python.
        assert test[:3] == ["CMD", "python", "-c"], name
        urls = _PROBE_URL.findall(test[3])
        assert len(urls) == 1, f"{name}: one http://127.0.0.1:PORT/PATH URL, got {urls}"
        port, path = urls[0]
        assert path == HEALTH_PATHS[subcommand], name
        assert int(port) in listen_ports(service), f"{name} probes {port}, it listens elsewhere"


class _Probed(BaseHTTPRequestHandler):
    path_served = "/healthz"
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == self.path_served else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def probe_server() -> Iterator[tuple[ThreadingHTTPServer, type[_Probed]]]:
    handler = type("Probed", (_Probed,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("subcommand", sorted(HEALTH_PATHS))
def test_healthcheck_probe_passes_only_on_a_healthy_answer(
    subcommand: str, probe_server: tuple[ThreadingHTTPServer, type[_Probed]]
) -> None:
    """Runs the service's health probe, as the container would, against a real local server."""
    server, handler = probe_server
    handler.path_served = HEALTH_PATHS[subcommand]
    name = next(name for name in HMAKV_SERVICES if subcommand_of(name) == subcommand)
    probe = healthcheck_test(SERVICES[name])[3]
    port = int(_PROBE_URL.findall(probe)[0][0])

    def probe_exit_code(target_port: int) -> int:
        code = probe.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{target_port}/")
        return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode

    live_port = server.server_address[1]
    assert probe_exit_code(live_port) == 0
    handler.status = 503
    assert probe_exit_code(live_port) != 0
    server.shutdown()
    server.server_close()
    assert probe_exit_code(live_port) != 0


# --- Kafka ---


def test_kafka_image_is_the_release_the_tests_run() -> None:
    image = SERVICES["kafka"]["image"]
    assert image == f"apache/kafka:{kafka_version()}", "bump compose with hmakv/kafka/pom.xml"


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    result = {}
    for listener in filter(None, value.split(",")):
        listener_name, address = listener.split("://")
        host, port = address.rsplit(":", 1)
        result[listener_name] = (host, int(port))
    return result


def test_kafka_listeners_agree_with_each_other_and_with_the_clients() -> None:
    kafka = SERVICES["kafka"]
    env = service_env(kafka)
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(
        item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    inter_broker = env["KAFKA_INTER_BROKER_LISTENER_NAME"]

    assert set(protocols) == set(listeners)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert controller in listeners and controller not in advertised
    assert set(advertised) == set(listeners) - {controller}
    for listener_name, (_, port) in advertised.items():
        assert port == listeners[listener_name][1], listener_name
    voter_id, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split("@")
    assert voter_id == env["KAFKA_NODE_ID"]
    assert voter == f"kafka:{listeners[controller][1]}"
    assert kafka["hostname"] == "kafka"

    internal_host, internal_port = advertised[inter_broker]
    assert internal_host == "kafka"
    bootstraps = {
        name: service_env(SERVICES[name]).get("HMAKV_KAFKA_BOOTSTRAP") for name in HMAKV_SERVICES
    }
    assert {"bridge", "index"} <= {name for name, value in bootstraps.items() if value}
    for name, bootstrap in bootstraps.items():
        assert bootstrap in (None, f"kafka:{internal_port}"), name
    assert f"--bootstrap-server localhost:{internal_port}" in " ".join(healthcheck_test(kafka))
    assert healthcheck_test(kafka)[1].count("/opt/kafka/bin/kafka-broker-api-versions.sh") == 1

    # The listener for the host: advertised as localhost, published on the same port.
    for listener_name, (host, port) in advertised.items():
        if listener_name != inter_broker:
            assert host == "localhost"
            assert PublishedPort("127.0.0.1", port, port) in published_ports(kafka)


def test_kafka_keeps_its_log_in_the_named_volume() -> None:
    env = service_env(SERVICES["kafka"])
    assert "kafka-data:" + env["KAFKA_LOG_DIRS"] in SERVICES["kafka"]["volumes"]
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


# --- the bridge and its engines ---


def test_bridge_follows_every_engine_at_its_zmq_ports() -> None:
    bridge = SERVICES["bridge"]
    engines_file = host_path(bridge, service_env(bridge)["HMAKV_BRIDGE_ENGINES"])
    assert engines_file is not None
    configured = load_engines_file(engines_file)  # the bridge's own reading of it
    engine_services = [name for name in HMAKV_SERVICES if subcommand_of(name) == "engine"]
    assert sorted(engine.name for engine in configured) == sorted(engine_services)
    assert len(engine_services) >= 2
    for engine in configured:
        env = service_env(SERVICES[engine.name])
        assert env["HMAKV_ENGINE_WORKER_NAME"] == engine.name
        for endpoint, variable in (
            (engine.endpoint, "HMAKV_ENGINE_ENDPOINT"),
            (engine.replay, "HMAKV_ENGINE_REPLAY_ENDPOINT"),
        ):
            match = _LISTEN_VALUE.match(env[variable])
            assert match, f"{engine.name}: {variable}={env[variable]} binds no port"
            assert endpoint == f"tcp://{engine.name}:{match['port']}", engine


def test_engines_run_both_profiles_on_cpu_without_the_model_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = [name for name in HMAKV_SERVICES if subcommand_of(name) == "engine"]
    parsed = {name: parse_service_command(SERVICES[name], monkeypatch)[1] for name in engines}
    assert sorted(args.profile for args in parsed.values()) == ["gemma3-like", "gpt-oss-like"]
    for name, args in parsed.items():
        assert args.no_model is True, name
        assert args.device == "cpu", name
        assert args.worker_name == name


@pytest.mark.parametrize(
    "name", [name for name in HMAKV_SERVICES if subcommand_of(name) == "engine"]
)
def test_engine_service_starts_and_passes_its_healthcheck(name: str, tmp_path: Path) -> None:
    """Runs the engine with exactly its compose environment (only the ports moved to free ones,
    no torch: the model is off by default), probes it with its compose health check, then stops
    it as `docker compose stop` does."""
    service = SERVICES[name]
    moved: dict[int, int] = {}
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    for key, value in container_environ(service).items():
        match = _LISTEN_VALUE.match(value)
        if match:
            moved[int(match["port"])] = free_port()
            value = value[: match.start("port")] + str(moved[int(match["port"])])
        env[key] = value
    probe = healthcheck_test(service)[3]
    old_port = int(_PROBE_URL.findall(probe)[0][0])
    probe = probe.replace(f"127.0.0.1:{old_port}/", f"127.0.0.1:{moved[old_port]}/")
    log = tmp_path / "engine.log"
    with log.open("wb") as output:
        engine = subprocess.Popen(
            [sys.executable, "-m", "hmakv.cli", *command_of(service)],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        deadline = time.monotonic() + 30
        while subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode:
            assert engine.poll() is None, f"{name} exited {engine.returncode}: {log.read_text()}"
            assert time.monotonic() < deadline, f"{name} never became healthy: {log.read_text()}"
            time.sleep(0.2)
    finally:
        engine.send_signal(signal.SIGTERM)
        exit_code = engine.wait(timeout=30)
    assert exit_code == 0, log.read_text()
    assert f"engine '{name}'" in log.read_text()


# --- the image ---


def _dockerfile_instructions() -> list[list[tuple[str, str]]]:
    """deploy/Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "deploy" / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), arguments.strip()))
    return stages


def test_dockerfile_runs_slim_python_311_as_a_non_root_user() -> None:
    preamble, *stages = _dockerfile_instructions()
    args = dict(a.split("=", 1) for kind, a in preamble if kind == "ARG" and "=" in a)
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", args["PYTHON_IMAGE"])
    for stage in stages:
        assert stage[0][0] == "FROM" and stage[0][1].startswith("${PYTHON_IMAGE} AS "), stage[0]
    runtime = stages[-1]
    assert runtime[0] == ("FROM", "${PYTHON_IMAGE} AS runtime")
    users = [a for kind, a in runtime if kind == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("ENTRYPOINT", '["hmakv"]') in runtime


def test_compose_build_args_are_declared_by_the_dockerfile() -> None:
    declared = {
        a.split("=")[0] for stage in _dockerfile_instructions() for k, a in stage if k == "ARG"
    }
    for name in HMAKV_SERVICES:
        build = SERVICES[name]["build"]
        assert set(build.get("args", {})) <= declared, name
        assert "EXTRAS" in build["args"], f"{name}: choose the image's extras explicitly"
    for name in HMAKV_SERVICES:
        if subcommand_of(name) != "engine":
            assert SERVICES[name]["build"]["args"]["EXTRAS"] == "", f"{name} needs no extras"
    images = {SERVICES[n]["image"]: SERVICES[n]["build"]["args"]["EXTRAS"] for n in HMAKV_SERVICES}
    for name in HMAKV_SERVICES:
        # One image name, one set of extras: services sharing an image must build it alike.
        assert images[SERVICES[name]["image"]] == SERVICES[name]["build"]["args"]["EXTRAS"]


def _dockerignore_rules() -> list[tuple[bool, str, re.Pattern[str]]]:
    """(re-include?, pattern, regex) for each .dockerignore line: ``*`` and ``?`` within one path
    segment, ``**`` across segments, ``!`` re-includes (Docker's syntax, minus character classes,
    which the file must not use)."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.removeprefix("!").strip("/")
        assert "[" not in pattern, f"character classes are not checked here: {line}"
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, pattern, re.compile(regex + r"\Z")))
    return rules


def _excluded(rules: list[tuple[bool, str, re.Pattern[str]]], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for negate, _, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def _build_context() -> list[str]:
    """The repository's files that `docker build` would send, as paths relative to the root."""
    rules = _dockerignore_rules()
    files: list[str] = []
    for directory, dirnames, filenames in os.walk(REPO):
        relative = Path(directory).relative_to(REPO).as_posix()
        prefix = "" if relative == "." else relative + "/"
        dirnames[:] = [
            d
            for d in dirnames
            if not _excluded(rules, prefix + d)
            or any(
                n and (p.startswith(prefix + d + "/") or p.startswith("**")) for n, p, _ in rules
            )
        ]
        # A link to a directory is sent as the link (Docker does not follow it): a file here.
        links = [d for d in dirnames if (Path(directory) / d).is_symlink()]
        dirnames[:] = [d for d in dirnames if d not in links]
        files.extend(prefix + f for f in [*filenames, *links] if not _excluded(rules, prefix + f))
    return sorted(files)


def test_dockerignore_sends_the_packages_and_keeps_local_state_out() -> None:
    rules = _dockerignore_rules()
    for path in ("pyproject.toml", "README.md", "hmakv/cli.py", "hmakv/kafka/pom.xml"):
        assert not _excluded(rules, path), path
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "benchmarks/results/x.json",
        "hmakv/__pycache__/cli.cpython-311.pyc",
        "hmakv.egg-info/PKG-INFO",
        "compose.yaml",
    ):
        assert _excluded(rules, path), path


def test_image_installs_from_exactly_what_the_build_context_sends(tmp_path: Path) -> None:
    """Stages the build context as .dockerignore filters it, applies the Dockerfile's COPY lines
    of the build stage, installs that as the Dockerfile does (pip, non-editable, no extras), then
    imports the installed copy with nothing of the repository on sys.path."""
    context = _build_context()
    assert "pyproject.toml" in context
    src = tmp_path / "src"
    src.mkdir()
    build_stage = _dockerfile_instructions()[1]
    assert ("WORKDIR", "/src") in build_stage
    copies = [a.split() for kind, a in build_stage if kind == "COPY"]
    assert copies, "the build stage copies nothing"
    for *sources, destination in copies:
        for source in sources:
            source = source.rstrip("/")
            chosen = [p for p in context if p == source or p.startswith(source + "/")]
            assert chosen, f"COPY {source}: .dockerignore leaves nothing of it in the context"
            for path in chosen:
                # A file lands in the destination directory; a directory's contents land there.
                inside = Path(path).name if path == source else path[len(source) + 1 :]
                target = src / destination / inside
                target.parent.mkdir(parents=True, exist_ok=True)
                if (REPO / path).is_symlink():
                    target.symlink_to(os.readlink(REPO / path))
                else:
                    shutil.copy2(REPO / path, target)

    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(site), str(src)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    assert (site / "bin" / "hmakv").is_file(), "the image's ENTRYPOINT script was not installed"

    # Every package of the repository's top level lands inside the one namespace, hmakv.
    repo_modules = {
        ("" if package == "hmakv" else "hmakv/") + path.relative_to(REPO).as_posix()
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if "__pycache__" not in path.parts and path.relative_to(REPO).parts[1:2] not in LINKED
    }
    installed = {path.relative_to(site).as_posix() for path in (site / "hmakv").rglob("*.py")}
    assert installed == repo_modules
    top_level = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")}
    assert top_level == {"hmakv", "bin"}

    probe = (
        "import sys; sys.path[:0] = [sys.argv[1]]; sys.path.extend(sys.argv[2:])\n"
        "import hmakv, hmakv.cli\n"
        "from hmakv.kafka.jars import POM_PATH\n"
        "assert hmakv.__file__.startswith(sys.argv[1]), hmakv.__file__\n"
        "assert POM_PATH.is_file(), POM_PATH\n"
        "print(' '.join(sorted(hmakv.cli.subcommand_names())))\n"
    )
    dependencies = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    # -S: no site-packages .pth files, so the repository's editable install stays out.
    run = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(site), *dependencies],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == sorted(subparsers(build_parser()))


# --- Prometheus and Grafana against the services compose defines ---


def _prometheus_config() -> dict[str, Any]:
    prometheus = SERVICES["prometheus"]
    flags = dict(arg.split("=", 1) for arg in command_of(prometheus) if "=" in arg)
    config = host_path(prometheus, flags["--config.file"])
    assert config == REPO / "deploy" / "prometheus" / "prometheus.yml"
    return load_yaml(config)


def test_prometheus_targets_are_compose_services_at_their_listen_ports() -> None:
    targets = [
        target
        for job in _prometheus_config()["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    assert targets
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in SERVICES, f"{target}: no compose service {host}"
        assert int(port) in listen_ports(SERVICES[host]), f"{target}: {host} listens elsewhere"


@pytest.mark.parametrize("subcommand", METRICS_SUBCOMMANDS)
def test_prometheus_scrapes_every_service_that_serves_metrics(subcommand: str) -> None:
    jobs = {job["job_name"]: job for job in _prometheus_config()["scrape_configs"]}
    job = jobs[f"hmakv-{subcommand}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    scraped = {t for static in job["static_configs"] for t in static["targets"]}
    names = [name for name in HMAKV_SERVICES if subcommand_of(name) == subcommand]
    assert names
    for name in names:
        # /metrics is on the main listener, --listen; the index's router port has none.
        listen = service_env(SERVICES[name]).get(f"HMAKV_{subcommand.upper()}_LISTEN", "")
        match = _LISTEN_VALUE.match(listen)
        assert match, f"{name}: no HMAKV_{subcommand.upper()}_LISTEN on every interface"
        assert f"{name}:{match['port']}" in scraped


def test_grafana_datasource_is_the_compose_prometheus_with_a_fixed_uid() -> None:
    grafana = SERVICES["grafana"]
    directory = host_path(grafana, "/etc/grafana/provisioning/datasources")
    assert directory == REPO / "deploy" / "grafana" / "provisioning" / "datasources"
    datasources = [
        source
        for path in sorted(directory.glob("*.yaml"))
        for source in load_yaml(path)["datasources"]
    ]
    assert [source["uid"] for source in datasources] == ["hmakv-prometheus"]
    (source,) = datasources
    assert source["type"] == "prometheus"
    match = re.fullmatch(r"http://(?P<host>[\w-]+):(?P<port>\d+)", source["url"])
    assert match, source["url"]
    assert match["host"] == "prometheus"
    assert int(match["port"]) in listen_ports(SERVICES["prometheus"])
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_grafana_loads_dashboards_from_the_repository_dashboards_dir() -> None:
    grafana = SERVICES["grafana"]
    directory = host_path(grafana, "/etc/grafana/provisioning/dashboards")
    assert directory == REPO / "deploy" / "grafana" / "provisioning" / "dashboards"
    providers = [
        provider
        for path in sorted(directory.glob("*.yaml"))
        for provider in load_yaml(path)["providers"]
    ]
    assert len(providers) == 1
    (provider,) = providers
    assert provider["type"] == "file"
    assert host_path(grafana, provider["options"]["path"]) == (
        REPO / "deploy" / "grafana" / "dashboards"
    )


def test_the_index_keeps_its_snapshot_key_when_its_container_is_recreated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--follower-id keys the index's snapshots; its default, the hostname, is a new container
    id each time the container is recreated, and the index would read the whole log again."""
    _, args = parse_service_command(SERVICES["index"], monkeypatch)
    assert args.follower_id == "index"
