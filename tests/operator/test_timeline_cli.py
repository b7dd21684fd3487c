"""`tardigrade timeline` against an API server: namespace from the context, --context, -o json."""

from __future__ import annotations

import copy
import json

import kubernetes
import pytest
import yaml
from tardigrade_operator.cli import app
from typer.testing import CliRunner

from tests.conftest import EXAMPLES

GROUP, VERSION, PLURAL = "tardigrade.dev", "v1alpha1", "trainingjobs"
RECOVERY = {"cause": "Preemption", "time": "2026-12-02T12:00:05Z", "attempt": 2,
            "fromReplicas": 2, "toReplicas": 2, "restoreStep": 40, "stepsLost": 7,
            "downtimeSeconds": 12.5, "reason": "tiny-gpt-a1-1: TerminationByKubelet"}


@pytest.fixture(scope="module")
def contexts(tmp_path_factory, shared_api):
    """A kubeconfig whose current context is in namespace ML; context ctx-lab is in LAB."""
    tmp = tmp_path_factory.mktemp("timeline")
    ml_ns, lab_ns = shared_api.new_namespace("ml"), shared_api.new_namespace("lab")
    config = yaml.safe_load(shared_api.kubeconfig.read_text())
    base = config["contexts"][0]
    ml, lab = copy.deepcopy(base), copy.deepcopy(base)
    ml["name"], ml["context"]["namespace"] = "ctx-ml", ml_ns
    lab["name"], lab["context"]["namespace"] = "ctx-lab", lab_ns
    config["contexts"], config["current-context"] = [ml, lab], "ctx-ml"
    path = tmp / "two-contexts"
    path.write_text(yaml.safe_dump(config))

    custom = kubernetes.client.CustomObjectsApi(shared_api.api)
    job = yaml.safe_load((EXAMPLES / "trainingjob.yaml").read_text())
    for namespace in (ml_ns, lab_ns):
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    name = job["metadata"]["name"]
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, ml_ns, PLURAL, name, {
        "status": {"phase": "Restarting", "attempt": 2, "replicas": 2, "step": 40,
                   "restarts": {"preemptions": 1, "total": 1}, "recoveries": [RECOVERY]}})
    return path, ml_ns, lab_ns


@pytest.fixture
def kubeconfig(contexts):
    return contexts[0]


def _run(*args: str):
    # A wide terminal, so the table does not fold its cells.
    return CliRunner().invoke(app, ["timeline", *args], env={"COLUMNS": "200"},
                              catch_exceptions=False)


def test_namespace_comes_from_the_current_context(contexts):
    kubeconfig, ml, _ = contexts
    result = _run("tiny-gpt", "--kubeconfig", str(kubeconfig), "-o", "json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert (shown["namespace"], shown["name"], shown["phase"]) == (ml, "tiny-gpt", "Restarting")
    assert shown["restarts"]["preemptions"] == 1
    assert (shown["stepsLost"], shown["downtimeSeconds"]) == (7, 12.5)
    assert [r["cause"] for r in shown["recoveries"]] == ["Preemption"]
    assert shown["recoveries"][0]["restoreStep"] == 40


def test_kubeconfig_from_the_environment_as_kubectl_reads_it(kubeconfig, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    result = _run("tiny-gpt")
    assert result.exit_code == 0, result.output
    assert "tiny-gpt: Restarting, attempt 2" in result.stdout
    assert "TerminationByKubelet" in result.stdout


def test_context_and_namespace_flags(contexts):
    kubeconfig, _, lab = contexts
    other = json.loads(_run("tiny-gpt", "--kubeconfig", str(kubeconfig), "--context", "ctx-lab",
                            "-o", "json").stdout)
    assert (other["namespace"], other["recoveries"]) == (lab, [])
    flagged = json.loads(_run("tiny-gpt", "--kubeconfig", str(kubeconfig), "-n", lab,
                              "-o", "json").stdout)
    assert flagged["namespace"] == lab


def test_unknown_context_and_missing_job_say_what_is_wrong(contexts):
    kubeconfig, ml, _ = contexts
    result = _run("tiny-gpt", "--kubeconfig", str(kubeconfig), "--context", "nope")
    assert result.exit_code == 1
    assert "--context nope" in result.stderr and "ctx-lab, ctx-ml" in result.stderr
    result = _run("ghost", "--kubeconfig", str(kubeconfig))
    assert result.exit_code == 1
    assert f"trainingjob {ml}/ghost: 404" in result.stderr


def test_no_kubeconfig_outside_a_pod_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    result = _run("tiny-gpt")
    assert result.exit_code == 1
    assert "not in a pod: pass --kubeconfig PATH" in result.stderr
    result = _run("tiny-gpt", "--kubeconfig", str(tmp_path / "missing"))
    assert result.exit_code == 1
    assert "missing: no such file" in result.stderr
