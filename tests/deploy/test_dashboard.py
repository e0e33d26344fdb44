"""deploy/grafana/dashboards/hmakv.json, the dashboard Grafana provisions from the repository.

Grafana cannot run here, so its JSON is checked for what Grafana needs (panels with targets, the
provisioned datasource's uid on every panel and target, template variables, unique ids), and
every query in it is run by a real Prometheus (Debian's ``prometheus``) scraping a real
``hmakv demo`` with the repository's scrape configuration: each must parse and return data (a
number, not only NaN), template variables set to All.
The configuration is changed in two ways only: its targets point at the demo's actual ports, and
scrapes happen every second instead of every five, so that rate windows fill within seconds.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hmakv.demo.services import Services, read_services
from hmakv.kafka.process import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "hmakv.json"
DATASOURCES = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
LOCAL_CONFIG = REPO / "deploy" / "prometheus" / "prometheus-local.yml"
HMAKV = Path(sys.executable).with_name("hmakv")

GRID_COLUMNS = 24
VARIABLES = {"worker", "group"}
# What Grafana would put in place of its built-in variables, for a 1 s scrape interval.
BUILTINS = {"$__rate_interval": "10s"}
STARTUP_WAIT_S = 120.0
DATA_WAIT_S = 90.0
EXIT_WAIT_S = 120.0
METRICS_OF_THE_STORY = (
    "hmakv_index_resident_blocks",
    "hmakv_index_partial_evictions_total",
    "hmakv_index_blocks_removed_total",
    "hmakv_bridge_events_received_total",
    "hmakv_bridge_gaps_detected_total",
    "hmakv_bridge_gaps_replayed_total",
    "hmakv_bridge_gaps_unrecoverable_total",
    "hmakv_bridge_frames_rejected_total",
    "hmakv_index_event_age_seconds_bucket",
    "hmakv_index_consumer_lag_records",
    "hmakv_bridge_worker_health",
    "hmakv_index_score_requests_total",
    "hmakv_index_score_hit_tokens_total",
    "hmakv_index_score_best_differs_total",
    "hmakv_index_broker_silence_seconds",
    "hmakv_index_worker_stale",
    "hmakv_index_worker_lag_seqs",
    "hmakv_index_speculative_blocks",
    "hmakv_index_speculative_blocks_outcomes_total",
    "hmakv_index_speculative_ttl_seconds",
    "hmakv_bridge_intake_age_seconds_bucket",
    "hmakv_index_fetch_age_seconds_bucket",
)


def load_dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels folded inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in all_panels(dashboard) if panel["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in query_panels(dashboard) for target in panel["targets"]]


def provisioned_uid() -> str:
    config = yaml.safe_load(DATASOURCES.read_text())
    uid: str = config["datasources"][0]["uid"]
    return uid


def substituted(expr: str) -> str:
    """The query as Grafana sends it with every template variable set to All (``.*``)."""
    for builtin, value in BUILTINS.items():
        expr = expr.replace(builtin, value)
    for name in VARIABLES:
        expr = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", ".*", expr)
    assert "$" not in expr, f"an unknown variable is left in {expr!r}"
    return expr


# ----------------------------------------------------------------------------- the JSON


def test_the_dashboard_has_a_stable_uid_title_and_panels() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "hmakv"
    assert dashboard["title"]
    assert dashboard["editable"] is False  # provisioned: edit the file, not the UI
    assert len(query_panels(dashboard)) >= 10


def test_every_panel_and_target_uses_the_provisioned_datasource() -> None:
    expected = {"type": "prometheus", "uid": provisioned_uid()}
    assert expected["uid"] == "hmakv-prometheus"
    for panel in query_panels(load_dashboard()):
        assert panel["datasource"] == expected, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == expected, (panel["title"], target["refId"])
            assert target["expr"].strip(), (panel["title"], target["refId"])
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_panel_ids_are_unique_and_panels_fit_the_grid() -> None:
    panels = all_panels(load_dashboard())
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), ids
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]


def test_worker_and_group_variables_query_the_provisioned_prometheus() -> None:
    dashboard = load_dashboard()
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert set(variables) == VARIABLES
    for variable in variables.values():
        assert variable["type"] == "query"
        assert variable["datasource"]["uid"] == provisioned_uid()
        assert variable["includeAll"] is True and variable["allValue"] == ".*"
        assert variable["query"]["query"].startswith("label_values(")
    used = {name for expr in expressions(dashboard) for name in re.findall(r"\$(\w+)", expr)}
    assert used <= VARIABLES | {"__rate_interval"}, used
    assert used >= VARIABLES  # a variable no panel uses would filter nothing


def test_the_panels_cover_the_hma_story_and_the_pipelines_health() -> None:
    text = "\n".join(expressions(load_dashboard()))
    missing = [metric for metric in METRICS_OF_THE_STORY if metric not in text]
    assert missing == []


# ----------------------------------------------------------------------------- with Prometheus


@dataclass(frozen=True)
class Scraped:
    prometheus: str
    services: Services


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path, (
        "prometheus is not on PATH: install Debian's `prometheus` package "
        "(apt-get install -y prometheus; scripts/setup does it)"
    )
    return path


def scrape_config(services: Services) -> dict[str, Any]:
    """The repository's local config, its targets moved to the demo's ports, scraping every 1 s."""
    config: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    addresses = {
        "hmakv-bridge": services.bridge.removeprefix("http://"),
        "hmakv-index": services.index.removeprefix("http://"),
    }
    assert {job["job_name"] for job in config["scrape_configs"]} == set(addresses)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [addresses[job["job_name"]]]}]
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    return config


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        document: dict[str, Any] = json.load(response)
        return document


def instant_query(prometheus: str, expr: str) -> dict[str, Any]:
    """Prometheus' answer; a query that does not parse comes back as its error document."""
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        return get_json(url)
    except urllib.error.HTTPError as error:
        document: dict[str, Any] = json.load(error)
        return document


def wait_until(what: str, check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(0.2)


def start_demo(workdir: Path, output: Path) -> subprocess.Popen[bytes]:
    command = [
        str(HMAKV),
        "demo",
        "--no-model",
        "--plain",
        "--duration",
        "600",
        "--workdir",
        str(workdir),
    ]
    with output.open("wb") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)


def wait_for_services(workdir: Path, demo: subprocess.Popen[bytes], output: Path) -> Services:
    found: list[Services] = []

    def up() -> bool:
        assert demo.poll() is None, f"the demo exited:\n{output.read_text()}"
        services = read_services(workdir)
        if services is not None:
            found.append(services)
        return services is not None

    wait_until("the demo's services.json appeared", up, STARTUP_WAIT_S)
    return found[-1]


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def stop(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    binary = prometheus_binary()
    root = tmp_path_factory.mktemp("dashboard")
    output = root / "demo-output.txt"
    demo = start_demo(root / "demo", output)
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        services = wait_for_services(root / "demo", demo, output)
        config = root / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(services)))
        url = f"http://127.0.0.1:{free_port()}"
        with (root / "prometheus.log").open("wb") as log:
            prometheus = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={root / 'tsdb'}",
                    f"--web.listen-address={url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until("Prometheus became ready", lambda: ready(f"{url}/-/ready"), STARTUP_WAIT_S)
        yield Scraped(prometheus=url, services=services)
    finally:
        if prometheus is not None:
            stop(prometheus, signal.SIGTERM)
        stop(demo, signal.SIGINT)


def test_prometheus_scrapes_the_bridge_and_the_index(scraped: Scraped) -> None:
    def both_up() -> bool:
        targets = get_json(f"{scraped.prometheus}/api/v1/targets")["data"]["activeTargets"]
        return {t["labels"]["job"] for t in targets if t["health"] == "up"} == {
            "hmakv-bridge",
            "hmakv-index",
        }

    wait_until("both targets were scraped", both_up, DATA_WAIT_S)


def test_every_dashboard_query_parses_and_returns_data(scraped: Scraped) -> None:
    pending = {substituted(expr) for expr in expressions(load_dashboard())}
    errors: dict[str, str] = {}

    def all_answered() -> bool:
        for expr in sorted(pending):
            answer = instant_query(scraped.prometheus, expr)
            if answer["status"] != "success":
                errors[expr] = f"{answer.get('errorType')}: {answer.get('error')}"
                pending.discard(expr)
            elif any(_finite(sample) for sample in answer["data"]["result"]):
                pending.discard(expr)
        return not pending

    deadline = time.monotonic() + DATA_WAIT_S
    while not all_answered() and time.monotonic() < deadline:
        time.sleep(1.0)
    assert errors == {}, "queries Prometheus refused"
    assert pending == set(), "queries that never returned a number"


def _finite(sample: dict[str, Any]) -> bool:
    """A vector sample with a number: a ratio of two idle rates is NaN, which shows nothing."""
    return math.isfinite(float(sample["value"][1]))


def test_the_variables_resolve_to_the_demos_workers_and_groups(scraped: Scraped) -> None:
    dashboard = load_dashboard()
    variables = {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"]}
    values: dict[str, set[str]] = {}

    def resolved() -> bool:
        for name, query in variables.items():
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
            assert match, query
            selector, label = substituted(match[1]), match[2]
            url = (
                f"{scraped.prometheus}/api/v1/label/{label}/values?"
                f"{urllib.parse.urlencode({'match[]': selector})}"
            )
            values[name] = set(get_json(url)["data"])
        return values["worker"] == set(scraped.services.engines) and bool(values["group"])

    wait_until("the worker and group variables resolved", resolved, DATA_WAIT_S)
    assert {"0", "1"} <= values["group"]
