"""deploy/grafana/aserve-dashboard.json: every PromQL expression names metrics a live server exports.

The dashboard is parsed as Grafana's export format (datasource `${DS_PROMETHEUS}`, a `$model_name`
template variable); each metric name in each target expression (and the variable's query) is
resolved to its family (`_bucket` / `_sum` / `_count` of a histogram, `_total` of a counter) and
checked against a `/metrics` scrape of a real tiny server after a few requests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "aserve-dashboard.json"
_METRIC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*:[A-Za-z0-9_:]*")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
pytestmark = pytest.mark.timeout(300)


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _expressions(dash: dict) -> list[str]:
    exprs = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (`ns:name` tokens; label matchers and ranges skipped)."""
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values may hold colons
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_strings)
    return set(_METRIC.findall(without_ranges))


def resolve(name: str, families: dict[str, str]) -> str | None:
    """The exported family `name` belongs to, given family name -> type; None when it is not exported."""
    if name in families and families[name] in ("gauge", "info", "unknown"):
        return name
    if name.endswith("_total") and families.get(name.removesuffix("_total")) == "counter":
        return name.removesuffix("_total")
    for suffix in _HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and families.get(base) == "histogram":
            return base
    return None


def test_resolve_strips_suffixes_by_family_type():
    families = {"vllm:a": "histogram", "vllm:b": "counter", "vllm:c": "gauge"}
    assert resolve("vllm:a_bucket", families) == resolve("vllm:a_count", families) == "vllm:a"
    assert resolve("vllm:b_total", families) == "vllm:b"
    assert resolve("vllm:c", families) == "vllm:c"
    assert resolve("vllm:a", families) is None  # a histogram is queried through its series
    assert resolve("vllm:b_count", families) is None and resolve("vllm:c_total", families) is None
    assert metric_names('sum(rate(vllm:x_total{model_name=~"a:b"}[1m])) / vllm:y') == {"vllm:x_total", "vllm:y"}


def test_dashboard_is_a_grafana_export():
    dash = _dashboard()
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert [v["name"] for v in dash["templating"]["list"]] == ["model_name"]
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("throughput", "first token", "inter-token", "queues", "kv cache", "prefix", "preemption"):
        assert topic in titles, topic
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert '$model_name' in target["expr"], target["expr"]
            names = metric_names(target["expr"])
            assert names and all(n.startswith("vllm:") for n in names), target["expr"]
    quantiles = [t["expr"] for p in dash["panels"] for t in p["targets"] if "histogram_quantile" in t["expr"]]
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.95", "0.99"):
            assert any(f"histogram_quantile({q}," in e and f"vllm:{metric}_bucket" in e and "[1m]" in e
                       for e in quantiles), (metric, q)


def test_every_dashboard_metric_is_exported_by_a_live_server(tmp_path):
    model = build_tiny_chat_model(tmp_path / "tiny")
    with serving(model, quiet_args()) as (_engine, address), httpx.Client(base_url=address.url, timeout=60) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4})
            assert r.status_code == 200
        text = http.get("/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    missing = {}
    for expr in _expressions(_dashboard()):
        for name in metric_names(expr):
            family = resolve(name, families)
            if family is None or not re.search(rf"^{re.escape(name)}[{{ ]", text, re.MULTILINE):
                missing[name] = expr
    assert not missing, missing
    # the requests show in what the dashboard plots
    generated = sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:generation_tokens"
                    for s in f.samples if s.name == "vllm:generation_tokens_total")
    assert generated == 8
