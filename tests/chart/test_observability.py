"""Chart options for platform tooling: the trainer PodMonitor and JSON operator logs."""

from __future__ import annotations

import json
import logging

import kopf
import pytest
from tardigrade_operator import cli
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_gang
from typer.testing import CliRunner

from tests.chart.test_helm import render


def _pod_monitor(*values: str) -> dict:
    docs = render("trainerMetrics.podMonitor.enabled=true", *values)
    return next(d for d in docs if d["kind"] == "PodMonitor")


def test_pod_monitor_is_off_by_default():
    assert not [d for d in render() if d["kind"] == "PodMonitor"]


def test_pod_monitor_selects_rank_0_of_the_pods_the_operator_renders():
    monitor = _pod_monitor()
    spec = parse_spec({"replicas": 2, "image": "trainer:1",
                       "checkpoint": {"path": "gs://bucket/tiny"}})
    pods = build_gang(JobRef("tiny", "ml", "uid"), spec, GangLaunch(3, 2, "latest"))
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [p["metadata"]["name"] for p in pods
                if wanted.items() <= p["metadata"]["labels"].items()]
    assert selected == ["tiny-a3-0"], "only rank 0 serves /metrics"
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    ports = {p["name"] for p in pods[0]["spec"]["containers"][0]["ports"]}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_pod_monitor_follows_the_watched_namespaces():
    monitor = _pod_monitor("watch.allNamespaces=false", "watch.namespaces={ml,lab}")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml", "lab"]}


def test_log_format_value_reaches_the_operator():
    def args(*values: str) -> list[str]:
        deployment = next(d for d in render(*values) if d["kind"] == "Deployment")
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--log-format=text" in args()
    assert "--log-format=json" in args("logFormat=json")


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_operator_logs_json_with_kopf_formatter(monkeypatch, restore_logging, capsys):
    ran = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: ran.update(kwargs))
    result = CliRunner().invoke(cli.app, ["operator", "run", "-A", "--standalone",
                                          "--log-format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert ran["clusterwide"] is True
    handler = next(h for h in logging.getLogger().handlers
                   if isinstance(h.formatter, kopf._core.actions.loggers.ObjectJsonFormatter))
    record = logging.LogRecord("tardigrade", logging.WARNING, __file__, 1, "gang %s", ("lost",),
                               None)
    line = json.loads(handler.format(record))
    assert (line["message"], line["severity"]) == ("gang lost", "warn")


def test_unknown_log_format_is_refused():
    result = CliRunner().invoke(cli.app, ["operator", "run", "-A", "--log-format", "xml"])
    assert result.exit_code == 2
    assert "--log-format" in result.output
