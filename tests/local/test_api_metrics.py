"""The API server's `GET /metrics`: `apiserver_request_total` as kube-apiserver counts it."""

from __future__ import annotations

import urllib.request

from api_helpers import running_server
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families


def request_totals(url: str) -> dict[tuple[str, str, str, str, str], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = {}
    for family in text_string_to_metric_families(text):
        if family.name == "apiserver_request":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    labels = sample.labels
                    totals[(labels["verb"], labels["resource"], labels["subresource"],
                            labels["scope"], labels["code"])] = sample.value
    return totals


def test_every_request_is_counted_by_verb_resource_scope_and_code(tmp_path):
    with running_server(tmp_path) as (server, kubeconfig):
        api = config.new_client_from_config(config_file=str(kubeconfig))
        core = client.CoreV1Api(api)
        pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
        core.create_namespaced_pod("default", pod)
        core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"}})
        core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"}})
        core.list_namespaced_pod("default")
        try:
            core.read_namespaced_pod("missing", "default")
        except client.ApiException as err:
            assert err.status == 404
        totals = request_totals(server.url)
    assert totals[("CREATE", "pods", "", "resource", "201")] == 1
    assert totals[("PATCH", "pods", "status", "resource", "200")] == 2
    assert totals[("LIST", "pods", "", "namespace", "200")] == 1
    assert totals[("GET", "pods", "", "resource", "404")] == 1
