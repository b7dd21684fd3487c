"""Conformance: the official `kubernetes` Python client against the local API server."""

from __future__ import annotations

import itertools
import threading

import pytest
from api_helpers import api, wait_for, widget, widget_crd  # noqa: F401  (fixture)
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

_names = itertools.count()


@pytest.fixture(scope="module")
def k(api):  # noqa: F811
    api_client = config.new_client_from_config(config_file=str(api.kubeconfig))
    ext = client.ApiextensionsV1Api(api_client)
    crd = widget_crd()
    try:
        ext.create_custom_resource_definition(crd)
    except ApiException as err:
        assert err.status == 409
    return api_client


@pytest.fixture
def core(k):
    return client.CoreV1Api(k)


@pytest.fixture
def custom(k):
    return client.CustomObjectsApi(k)


def name(prefix: str = "o") -> str:
    return f"{prefix}-{next(_names)}"


def cm(n: str, **meta) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n, **meta},
            "data": {"k": "v"}}


def status_of(err: ApiException) -> dict:
    import json

    return json.loads(err.body)


def test_server_sets_metadata_and_generation(custom):
    n = name("w")
    created = custom.create_namespaced_custom_object("example.dev", "v1", "default", "widgets",
                                                     widget(n))
    meta = created["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    rv1 = int(meta["resourceVersion"])
    after_status = custom.patch_namespaced_custom_object_status(
        "example.dev", "v1", "default", "widgets", n, {"status": {"phase": "Running"}})
    assert after_status["metadata"]["generation"] == 1  # status changes do not bump it
    assert int(after_status["metadata"]["resourceVersion"]) > rv1
    after_spec = custom.patch_namespaced_custom_object(
        "example.dev", "v1", "default", "widgets", n,
        {"spec": {"replicas": 2}, "status": {"phase": "Ignored"}})
    assert after_spec["metadata"]["generation"] == 2
    assert after_spec["status"]["phase"] == "Running"  # main resource ignores .status
    same = custom.patch_namespaced_custom_object("example.dev", "v1", "default", "widgets", n,
                                                 {"spec": {"replicas": 2}})
    assert same["metadata"]["resourceVersion"] == after_spec["metadata"]["resourceVersion"]


def test_conflicts_not_found_and_already_exists(core):
    n = name("c")
    created = core.create_namespaced_config_map("default", cm(n))
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map("default", cm(n))
    assert exc.value.status == 409
    assert status_of(exc.value)["reason"] == "AlreadyExists"
    assert status_of(exc.value)["message"] == f'configmaps "{n}" already exists'
    stale = cm(n, resourceVersion=created.metadata.resource_version)
    core.replace_namespaced_config_map(n, "default", {**cm(n), "data": {"k": "new"}})
    with pytest.raises(ApiException) as exc:
        core.replace_namespaced_config_map(n, "default", stale)
    body = status_of(exc.value)
    assert (exc.value.status, body["reason"]) == (409, "Conflict")
    assert body["message"] == (f'Operation cannot be fulfilled on configmaps "{n}": the object '
                               "has been modified; please apply your changes to the latest "
                               "version and try again")
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_config_map("missing", "default")
    body = status_of(exc.value)
    assert (exc.value.status, body["reason"], body["kind"]) == (404, "NotFound", "Status")
    assert body["details"] == {"name": "missing", "kind": "configmaps"}


def test_dry_run_does_not_store(core):
    n = name("dry")
    out = core.create_namespaced_config_map("default", cm(n), dry_run="All")
    assert out.metadata.name == n
    with pytest.raises(ApiException):
        core.read_namespaced_config_map(n, "default")


def test_list_pagination_and_selectors(core):
    label = name("batch")
    for i in range(5):
        core.create_namespaced_config_map("default", cm(f"{label}-{i}", labels={"b": label}))
    page = core.list_namespaced_config_map("default", label_selector=f"b={label}", limit=2)
    assert [i.metadata.name for i in page.items] == [f"{label}-0", f"{label}-1"]
    assert page.metadata._continue and page.metadata.remaining_item_count == 3
    rest = core.list_namespaced_config_map("default", label_selector=f"b={label}", limit=10,
                                           _continue=page.metadata._continue)
    assert len(rest.items) == 3
    listed = core.list_config_map_for_all_namespaces(field_selector=f"metadata.name={label}-3")
    assert [i.metadata.name for i in listed.items] == [f"{label}-3"]
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod("default", field_selector="spec.bogus=x")
    assert exc.value.status == 400
    assert status_of(exc.value)["message"] == "field label not supported: spec.bogus"


def test_watch_replays_from_resource_version_and_filters(core):
    label = name("w")
    first = core.create_namespaced_config_map("default", cm(f"{label}-a", labels={"w": label}))
    rv = first.metadata.resource_version
    core.create_namespaced_config_map("default", cm(f"{label}-b", labels={"w": label}))
    core.create_namespaced_config_map("default", cm(f"{label}-other"))
    core.delete_namespaced_config_map(f"{label}-a", "default")
    w = watch.Watch()
    seen = []
    for event in w.stream(core.list_namespaced_config_map, "default", label_selector=f"w={label}",
                          resource_version=rv, timeout_seconds=1):
        seen.append((event["type"], event["object"].metadata.name))
    assert seen == [("ADDED", f"{label}-b"), ("DELETED", f"{label}-a")]


def test_watch_relabel_moves_objects_in_and_out_of_selection(core):
    label = name("sel")
    obj = core.create_namespaced_config_map("default", cm(label))
    rv = obj.metadata.resource_version
    core.patch_namespaced_config_map(label, "default", {"metadata": {"labels": {"s": label}}})
    core.patch_namespaced_config_map(label, "default", {"metadata": {"labels": {"s": "no"}}})
    events = [(e["type"], e["object"].metadata.name) for e in watch.Watch().stream(
        core.list_namespaced_config_map, "default", label_selector=f"s={label}",
        resource_version=rv, timeout_seconds=1)]
    assert events == [("ADDED", label), ("DELETED", label)]


def test_watch_too_old_resource_version_is_410(api, core):  # noqa: F811
    core.create_namespaced_config_map("default", cm(name("old")))
    api.call(api.server.store.compact)
    stream = watch.Watch().stream(core.list_namespaced_config_map, "default",
                                  resource_version="1", timeout_seconds=2)
    with pytest.raises(ApiException) as exc:
        list(stream)
    assert exc.value.status == 410
    assert "too old resource version" in exc.value.reason


def test_watch_bookmarks_and_initial_events_end(k):
    import json
    import urllib.request

    url = k.configuration.host
    req = urllib.request.Request(
        f"{url}/api/v1/namespaces/default/configmaps?watch=true&sendInitialEvents=true"
        "&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1")
    with urllib.request.urlopen(req) as resp:
        events = [json.loads(line) for line in resp]
    types = [e["type"] for e in events]
    first_bookmark = types.index("BOOKMARK")
    assert set(types[:first_bookmark]) == {"ADDED"}
    marker = events[first_bookmark]["object"]["metadata"]
    assert marker["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(marker["resourceVersion"]) > 0


def test_live_watch_sees_events(core):
    label = name("live")
    received = []
    done = threading.Event()
    w = watch.Watch()

    def consume():
        for event in w.stream(core.list_namespaced_config_map, "default",
                              label_selector=f"l={label}", timeout_seconds=5):
            received.append(event["type"])
            if len(received) == 2:
                w.stop()
        done.set()

    t = threading.Thread(target=consume)
    t.start()
    core.create_namespaced_config_map("default", cm(label, labels={"l": label}))
    # Patch only once the watch has seen the object: a watch that connects after the patch
    # starts from the current state and gets one ADDED, correctly.
    wait_for(lambda: received, what="the ADDED event")
    core.patch_namespaced_config_map(label, "default", {"data": {"k": "2"}})
    assert done.wait(6)
    assert received == ["ADDED", "MODIFIED"]


def test_finalizers_and_deletion_timestamp(custom):
    n = name("fin")
    body = widget(n)
    body["metadata"]["finalizers"] = ["example.dev/hold"]
    custom.create_namespaced_custom_object("example.dev", "v1", "default", "widgets", body)
    deleted = custom.delete_namespaced_custom_object("example.dev", "v1", "default", "widgets", n)
    assert deleted["metadata"]["deletionTimestamp"]
    obj = custom.get_namespaced_custom_object("example.dev", "v1", "default", "widgets", n)
    assert obj["metadata"]["deletionTimestamp"]
    with pytest.raises(ApiException) as exc:
        custom.patch_namespaced_custom_object(
            "example.dev", "v1", "default", "widgets", n,
            {"metadata": {"finalizers": ["example.dev/hold", "example.dev/new"]}})
    assert exc.value.status == 422
    assert "no new finalizers can be added if the object is being deleted" in exc.value.body
    custom.patch_namespaced_custom_object("example.dev", "v1", "default", "widgets", n,
                                          {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as exc:
        custom.get_namespaced_custom_object("example.dev", "v1", "default", "widgets", n)
    assert exc.value.status == 404


def _owned(core, owner, n, block=False):
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": owner.metadata.name,
           "uid": owner.metadata.uid, "blockOwnerDeletion": block}
    return core.create_namespaced_config_map("default", cm(n, ownerReferences=[ref]))


def _exists(core, n):
    try:
        return core.read_namespaced_config_map(n, "default")
    except ApiException as err:
        assert err.status == 404
        return None


def test_gc_background_and_orphan(core):
    owner = core.create_namespaced_config_map("default", cm(name("owner")))
    dep = _owned(core, owner, name("dep")).metadata.name
    core.delete_namespaced_config_map(owner.metadata.name, "default",
                                      propagation_policy="Background")
    wait_for(lambda: _exists(core, dep) is None, what="background collection")
    owner = core.create_namespaced_config_map("default", cm(name("owner")))
    dep = _owned(core, owner, name("dep")).metadata.name
    core.delete_namespaced_config_map(owner.metadata.name, "default",
                                      propagation_policy="Orphan")
    wait_for(lambda: _exists(core, owner.metadata.name) is None, what="owner gone")
    orphan = _exists(core, dep)
    assert orphan is not None and not orphan.metadata.owner_references


def test_gc_foreground_waits_for_blocking_dependents(core):
    owner = core.create_namespaced_config_map("default", cm(name("owner")))
    dep = _owned(core, owner, name("dep"), block=True).metadata.name
    core.patch_namespaced_config_map(dep, "default",
                                     {"metadata": {"finalizers": ["example.dev/slow"]}})
    core.delete_namespaced_config_map(owner.metadata.name, "default",
                                      propagation_policy="Foreground")
    held = wait_for(lambda: (lambda d: d if d and d.metadata.deletion_timestamp else None)(
        _exists(core, dep)), what="dependent being deleted")
    assert held
    still = _exists(core, owner.metadata.name)
    assert still is not None and "foregroundDeletion" in still.metadata.finalizers
    core.patch_namespaced_config_map(dep, "default", {"metadata": {"finalizers": None}})
    wait_for(lambda: _exists(core, owner.metadata.name) is None, what="owner finally gone")


def test_scale_subresource_round_trip(custom):
    n = name("sc")
    custom.create_namespaced_custom_object("example.dev", "v1", "default", "widgets",
                                           widget(n, replicas=2))
    scale = custom.get_namespaced_custom_object_scale("example.dev", "v1", "default", "widgets",
                                                      n)
    assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
    assert scale["spec"]["replicas"] == 2
    custom.patch_namespaced_custom_object_scale("example.dev", "v1", "default", "widgets", n,
                                                {"spec": {"replicas": 4}})
    obj = custom.get_namespaced_custom_object("example.dev", "v1", "default", "widgets", n)
    assert obj["spec"]["replicas"] == 4
    with pytest.raises(ApiException) as exc:
        custom.patch_namespaced_custom_object_scale("example.dev", "v1", "default", "widgets", n,
                                                    {"spec": {"replicas": 0}})
    assert exc.value.status == 422
    assert "spec.replicas in body should be greater than or equal to 1" in exc.value.body


def test_pod_graceful_delete_eviction_and_binding(k, core):
    n = name("pod")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": n},
           "spec": {"containers": [{"name": "main", "image": "local/python"}]}}
    created = core.create_namespaced_pod("default", pod)
    assert created.status.phase == "Pending"
    assert created.spec.termination_grace_period_seconds == 30
    core.create_namespaced_pod_binding(n, "default", {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": n},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-x"}},
        _preload_content=False)
    assert core.read_namespaced_pod(n, "default").spec.node_name == "node-x"
    policy = client.PolicyV1Api(k)
    policy_body = {"apiVersion": "policy/v1", "kind": "Eviction",
                   "metadata": {"name": n, "namespace": "default"}}
    core.create_namespaced_pod_eviction(n, "default", policy_body)
    evicted = core.read_namespaced_pod(n, "default")
    assert evicted.metadata.deletion_timestamp is not None
    assert evicted.metadata.deletion_grace_period_seconds == 30
    cond = [c for c in evicted.status.conditions if c.type == "DisruptionTarget"]
    assert cond and cond[0].reason == "EvictionByEvictionAPI"
    # The kubelet finishes the job with a zero grace period.
    core.delete_namespaced_pod(n, "default", grace_period_seconds=0)
    assert policy is not None
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod(n, "default")
    assert exc.value.status == 404


def test_namespace_deletion_removes_contents(core):
    ns = name("ns")
    core.create_namespace({"metadata": {"name": ns}})
    core.create_namespaced_config_map(ns, cm("inside"))
    core.delete_namespace(ns)
    wait_for(lambda: not any(n.metadata.name == ns for n in core.list_namespace().items),
             what="namespace gone")
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map(ns, cm("late"))
    assert exc.value.status == 404


def test_scale_rejects_negative_replicas(custom):
    n = name("neg")
    custom.create_namespaced_custom_object("example.dev", "v1", "default", "widgets", widget(n))
    with pytest.raises(ApiException) as exc:
        custom.patch_namespaced_custom_object_scale("example.dev", "v1", "default", "widgets", n,
                                                    {"spec": {"replicas": -1}})
    body = status_of(exc.value)
    assert body["message"] == (f'Scale.autoscaling "{n}" is invalid: spec.replicas: Invalid '
                               "value: -1: must be greater than or equal to 0")


def test_new_namespaces_get_a_default_service_account(core):
    ns = name("sa")
    core.create_namespace({"metadata": {"name": ns}})
    assert core.read_namespaced_service_account("default", ns).metadata.name == "default"


def test_gc_collects_many_dependents(core):
    owner = core.create_namespaced_config_map("default", cm(name("many")))
    deps = [_owned(core, owner, name("d")).metadata.name for _ in range(50)]
    core.delete_namespaced_config_map(owner.metadata.name, "default")
    wait_for(lambda: all(_exists(core, d) is None for d in deps), what="all dependents")


@pytest.mark.parametrize(("resources", "qos"), [
    ({}, "BestEffort"),
    ({"requests": {"cpu": "1"}}, "Burstable"),
    ({"limits": {"cpu": "1", "memory": "1Gi"}}, "Guaranteed"),
])
def test_pod_qos_class(core, resources, qos):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name("qos")},
           "spec": {"containers": [{"name": "c", "image": "x", "resources": resources}]}}
    assert core.create_namespaced_pod("default", pod).status.qos_class == qos


def test_eviction_honours_pod_disruption_budgets(k, core):
    label = name("pdb")
    policy = client.PolicyV1Api(k)
    policy.create_namespaced_pod_disruption_budget("default", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": label},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": label}}}})
    pods = []
    for i in range(2):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{label}-{i}", "labels": {"app": label}},
               "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}}
        core.create_namespaced_pod("default", pod)
        core.patch_namespaced_pod_status(f"{label}-{i}", "default", {"status": {
            "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
        pods.append(f"{label}-{i}")
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": pods[0], "namespace": "default"}}
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod_eviction(pods[0], "default", eviction)
    body = status_of(exc.value)
    assert (exc.value.status, body["reason"]) == (429, "TooManyRequests")
    assert body["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    assert body["details"]["causes"][0]["message"] == (
        f"The disruption budget {label} needs 2 healthy pods and has 2 currently")
    policy.patch_namespaced_pod_disruption_budget(label, "default", {"spec": {"minAvailable": 1}})
    core.create_namespaced_pod_eviction(pods[0], "default", eviction)
    assert core.read_namespaced_pod(pods[0], "default").metadata.deletion_timestamp


def test_generation_only_where_the_real_server_keeps_one(core):
    created = core.create_namespaced_config_map("default", cm(name("gen")))
    assert created.metadata.generation is None
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name("gen")},
           "spec": {"containers": [{"name": "c", "image": "x"}]}}
    assert core.create_namespaced_pod("default", pod).metadata.generation == 1


def test_services_get_distinct_cluster_ips_and_headless_stays_none(core):
    ips = set()
    for _ in range(3):
        svc = core.create_namespaced_service("default", {
            "metadata": {"name": name("svc")}, "spec": {"ports": [{"port": 80}]}})
        ips.add(svc.spec.cluster_ip)
    assert len(ips) == 3
    headless = core.create_namespaced_service("default", {
        "metadata": {"name": name("hl")}, "spec": {"clusterIP": "None", "ports": [{"port": 1}]}})
    assert headless.spec.cluster_ip == "None"


def test_annotations_are_limited_to_256k(core):
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map("default", cm(name("ann"),
                                                        annotations={"a": "x" * 262145}))
    assert exc.value.status == 422
    assert "metadata.annotations: Too long: must have at most 262144 bytes" in exc.value.body


def test_legacy_watch_prefix(k, core):
    import json
    import urllib.request

    n = name("legacy")
    core.create_namespaced_config_map("default", cm(n))
    url = k.configuration.host
    for path in (f"/api/v1/watch/namespaces/default/configmaps?fieldSelector=metadata.name%3D{n}",
                 f"/api/v1/watch/namespaces/default/configmaps/{n}?"):
        with urllib.request.urlopen(f"{url}{path}&timeoutSeconds=1") as resp:
            events = [json.loads(line) for line in resp]
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", n)]


def test_pod_spec_checks_use_the_real_text(core):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name("bad")},
           "spec": {"restartPolicy": "Sometimes", "containers": [
               {"name": "c", "image": "x", "ports": [{"containerPort": 70000}]},
               {"name": "c", "image": "x"}]}}
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod("default", pod)
    message = status_of(exc.value)["message"]
    for text in ('spec.restartPolicy: Unsupported value: "Sometimes": supported values: '
                 '"Always", "OnFailure", "Never"',
                 "spec.containers[0].ports[0].containerPort: Invalid value: 70000: must be "
                 "between 1 and 65535, inclusive",
                 'spec.containers[1].name: Duplicate value: "c"'):
        assert text in message
