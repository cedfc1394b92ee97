"""Operating pieces that need no server: the Kubernetes example against the CLI and the app's
routes, the JSON log format, the stats line, loading progress lines, the engine's histograms and
their Health fields."""

from __future__ import annotations

import json
import logging
from pathlib import Path
import re
from types import SimpleNamespace

import msgspec
import pytest
import yaml

from engine.core.stats import STEP_TIME_BUCKETS, Histogram
from engine.interface import Health
from entrypoints.cli import build_parser
from entrypoints.http.app import create_app
from entrypoints.http.metrics import EngineCollector
from entrypoints.logs import JsonFormatter
from entrypoints.stats_log import StatsLine
from states import State

ROOT = Path(__file__).resolve().parents[1]
MARGIN_S = 5  # the release plus slack, beyond preStop + drain


def _k8s():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service"}
    return kinds["Deployment"], kinds["Service"]


def test_kubernetes_example_matches_the_cli_and_the_app():
    deploy, service = _k8s()
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["enginecore"]
    a = build_parser().parse_args(c["args"])  # every flag exists (argparse exits otherwise)
    assert a.cmd == "serve" and a.http and a.api_servers >= 1
    port = int(a.http.rpartition(":")[2])
    assert c["ports"][0]["containerPort"] == port
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]

    app = create_app(SimpleNamespace(model="m", state=State.SERVING, max_model_len=0,
                                     on_state_change=lambda listener: None))
    routes = {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    probes = [c[k]["httpGet"] for k in ("readinessProbe", "livenessProbe", "startupProbe")]
    for p in probes:
        assert p["path"] in routes and p["port"] in (port, c["ports"][0]["name"])
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes

    # the drain advice (docs/serving.md): grace >= preStop + --drain-timeout + release + margin (45 at 30 s)
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + a.drain_timeout + MARGIN_S
    assert a.drain_timeout == 30 and grace == 45
    assert "**45**" in (ROOT / "docs" / "serving.md").read_text()


def test_json_log_lines_carry_the_structured_fields():
    rec = logging.LogRecord("enginecore.states", logging.INFO, __file__, 1,
                            "engine: %s -> %s", ("serving", "draining"), None)
    rec.state, rec.running, rec.request_id = "draining", 17, "cmpl-1"
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["message"] == "engine: serving -> draining" and obj["level"] == "info"
    assert obj["logger"] == "enginecore.states" and re.match(r"\d{4}-\d\d-\d\dT", obj["timestamp"])
    assert (obj["state"], obj["running"], obj["request_id"]) == ("draining", 17, "cmpl-1")
    assert "args" not in obj and "msg" not in obj


def _stats(prompt, gen, running=0, waiting=0, **kw):
    return SimpleNamespace(prompt_tokens=prompt, generation_tokens=gen, running=running,
                           waiting=waiting, kv_usage=0.25, preemptions=3, **kw)


def test_stats_line_rates_and_quiet_when_idle():
    lines = StatsLine()
    lines.line(_stats(0, 0), 100.0)
    level, msg, fields = lines.line(_stats(100, 40, running=2, waiting=1), 102.0)
    assert level == logging.INFO
    assert msg.startswith("prompt 50.0 tok/s, generation 20.0 tok/s; 2 running, 1 waiting; "
                          "KV cache 25.0%; 3 preemptions")
    assert fields["generation_tokens_per_s"] == 20.0
    level, msg, _ = lines.line(_stats(100, 40, prefix_cache_queries=10, prefix_cache_hits=4), 104.0)
    assert level == logging.DEBUG and msg.endswith("prefix cache hit rate 40.0%")


def test_loading_progress_lines(caplog):
    from engine.loader.progress import LoadProgress

    with caplog.at_level(logging.INFO, logger="enginecore.loader"):
        with LoadProgress("loading weights", 3, 3 << 20, interval=0.0, bar=False) as p:
            for _ in range(3):
                p.advance(1 << 20)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0].startswith("loading weights: 1/3 tensors, 1.0 MiB/3.0 MiB (")
    assert re.match(r"loading weights: done, 3/3 tensors, 3\.0 MiB/3\.0 MiB \(.+/s\) in [\d.]+ s",
                    msgs[-1])
    caplog.clear()
    with pytest.raises(RuntimeError), caplog.at_level(logging.INFO, logger="enginecore.loader"):
        with LoadProgress("x", 1, 1, interval=60, bar=False):
            raise RuntimeError("failed load")
    assert not any("done" in r.getMessage() for r in caplog.records)  # no success line


def test_histogram_buckets_are_le_and_travel_in_health():
    h = Histogram(STEP_TIME_BUCKETS)
    for v in (0.001, 0.0011, 99.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts[0] == 1 and snap.counts[1] == 1 and snap.counts[-1] == 1 and snap.count == 3
    wire = Health(state=State.SERVING, live=True, ready=True, steps=3,
                  step_time_counts=list(snap.counts), step_time_sum=snap.sum)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=Health)
    assert back.step_time_counts == list(snap.counts) and back.steps == 3
    old = msgspec.msgpack.encode(Health(state=State.SERVING, live=True, ready=True))
    assert msgspec.msgpack.decode(old, type=Health).step_time_counts == []  # optional fields

    col = EngineCollector()
    col.update(back)
    text = {f.name: f for f in col.collect()}
    buckets = {s.labels.get("le"): s.value for s in text["enginecore_step_time_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["0.001"] == 1 and buckets["0.0025"] == 2 and buckets["+Inf"] == 3
    col.update(Health(state=State.SHUTDOWN, live=False, ready=False))  # core released: zeros
    fams = {f.name: f for f in col.collect()}
    assert fams["enginecore_engine_steps"].samples[0].value == 3  # counters never go back
