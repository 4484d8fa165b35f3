"""The operator's kit in deploy/observability: every metric the Grafana dashboard and the Prometheus alert rules
query is one a live kvgate exports (a gateway with an engine pool, cache-aware routing, tenants, a quota store and
DNS discovery, after real requests), the alert rules pass `promtool check rules` (Debian's prometheus package), and
so does every dashboard query, checked as a recording rule."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission.config import hash_key
from gateway.config import GatewayConfig
from gateway.embedded import running_gateway
from gateway.keys import POOL

KIT = Path(__file__).resolve().parent.parent / "deploy" / "observability"
DASHBOARD = KIT / "grafana-kvgate.json"
ALERTS = KIT / "kvgate-alerts.yaml"
NAME = re.compile(r"\bkvgate_[a-z_]+\b")
PROMTOOL = shutil.which("promtool")


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    text = " ".join(dashboard_queries())
    for metric in ("kvgate_time_to_first_token_seconds_bucket", "kvgate_inter_token_latency_seconds_bucket",
                   "kvgate_queue_depth", "kvgate_queue_wait_seconds_bucket", "kvgate_admission_rejections_total",
                   "kvgate_prefix_predicted_cached_tokens_total", "kvgate_prefix_reported_cached_tokens_total",
                   'kvgate_tokens_total{kind="cached"}', "kvgate_tenant_requests_total",
                   "kvgate_replica_ready"):  # fmt: skip
        assert metric in text, metric
    assert {r["alert"] for r in alert_rules()} >= {"KvgateNoReadyReplica", "KvgateHighRejectionRate",
                                                   "KvgatePrefixParityGap", "KvgateCrashLoop"}  # fmt: skip


async def test_every_queried_metric_is_one_kvgate_exports(tmp_path: Path) -> None:
    cfg = GatewayConfig.model_validate({
        "server": {"port": 0, "access_log": "off"},
        "admin": {"key": "adm"},  # with tenant auth on, /metrics takes the admin key
        "health": {"interval_s": 0.2, "metrics_interval_s": 0.2},
        "routing": {"policy": "cache-aware"},
        "cache": {"tokenizers": {"m": "sim"}},
        "admission": {"auth": True,
                      "tenants": {"alice": {"keys": [hash_key("sk-alice")], "limits": {"max_concurrency": 4}}},
                      "redis": {"url": "redis://127.0.0.1:1/0", "timeout_s": 0.1}},
        "engines": [{"dns": {"name": "nothing.test", "port": 1, "nameserver": "127.0.0.1:9", "timeout_s": 0.2,
                             "interval_s": 0.2}}],
        "pool": {"log_dir": str(tmp_path / "logs"), "models": [{"name": "m", "kind": "sim", "replicas": 1}]},
    })  # fmt: skip
    async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
        await gw.app[POOL].wait_ready(timeout_s=60)
        for i in range(3):  # streamed, so every latency histogram gets samples
            body = {"model": "m", "messages": [{"role": "user", "content": f"hello {i} " * 40}], "max_tokens": 8,
                    "stream": True}  # fmt: skip
            async with http.post(f"{gw.url}/v1/chat/completions", json=body,
                                 headers={"Authorization": "Bearer sk-alice"}) as resp:  # fmt: skip
                assert resp.status == 200 and "[DONE]" in await resp.text()
        async with http.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer adm"}) as resp:
            page = await resp.text()
    families = list(text_string_to_metric_families(page))
    exported = {f.name for f in families} | {s.name for f in families for s in f.samples}
    queried = {n for q in [*dashboard_queries(), *(r["expr"] for r in alert_rules())] for n in NAME.findall(q)}
    missing = sorted(n for n in queried if n not in exported and re.sub(r"_(bucket|sum|count|total)$", "", n)
                     not in exported)  # fmt: skip
    assert not missing, f"queried but not exported: {missing}"
    assert len(queried) >= 20


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (apt install prometheus)")
def test_promtool_accepts_the_alert_rules_and_every_dashboard_query(tmp_path: Path) -> None:
    subprocess.run([str(PROMTOOL), "check", "rules", str(ALERTS)], check=True, capture_output=True)
    records = [{"record": f"kvgate:dashboard:query{i}", "expr": q.replace("$__rate_interval", "5m")}
               for i, q in enumerate(dashboard_queries())]  # fmt: skip
    rules = tmp_path / "dashboard-queries.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    done = subprocess.run([str(PROMTOOL), "check", "rules", str(rules)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(records)} rules found" in done.stdout
