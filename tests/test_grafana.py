"""The Grafana dashboard (docs/grafana/corral.json) is import-ready and every query in it is
valid PromQL (`promtool`) over metrics a real corral exports (its /metrics, scraped)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, Corral, CorralFactory, tiny_config

DASHBOARD = REPO / "docs" / "grafana" / "corral.json"
# Names of corral's series; label values and strings are taken out of a query before it is
# searched, so `{kind="corral"}` is not read as a metric.
METRIC = re.compile(r"\bcorral_[a-z0-9_]+\b")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# What Grafana substitutes before a query reaches Prometheus, with values it could take.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h",
                     "$model": ".*"}
# What each metric type adds to a family's name in the exposition.
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum",
                                                             "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries() -> list[str]:
    """Every PromQL query the dashboard sends: its panels' targets and its variables'."""
    found = [t["expr"] for p in panels(dashboard()["panels"]) for t in p.get("targets", [])]
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        found.append(query["query"] if isinstance(query, dict) else query)
    return found


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"])
    config["groups"] = {"pair": {"type": "parallel", "models": ["tiny-a", "tiny-b"]}}
    return start_corral_module(config)


@pytest.fixture(scope="module")
def exported(corral: Corral) -> set[str]:
    """The series names a real corral's /metrics has, after some traffic; a family with no
    sample yet (no eviction happened) counts by its declared name and type."""
    assert corral.chat("tiny-a", max_tokens=4).status_code == 200
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "pair", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    text = corral.http.get("/metrics").text
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_the_dashboard_is_import_ready() -> None:
    data = dashboard()
    assert data["title"] and data["uid"] and data["schemaVersion"] >= 36
    assert [i["name"] for i in data["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in panels(data["panels"])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels(data["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_every_query_names_metrics_corral_exports(exported: set[str]) -> None:
    assert len(exported) > 40, sorted(exported)  # the scrape itself worked
    unknown = {}
    for query in queries():
        named = set(METRIC.findall(STRING.sub('""', query)))
        assert named, f"names no corral metric: {query}"
        if named - exported:
            unknown[query] = sorted(named - exported)
    assert not unknown, unknown


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make system-deps` installs Debian's prometheus"
    rules = []
    for i, query in enumerate(queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        if query.startswith("label_values("):  # Grafana's own function, over a metric
            query = query.removeprefix("label_values(").split(",")[0]
        rules.append({"record": f"corral:dashboard_query:{i}", "expr": query})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
