"""The tests' pod recorder against a real kube-apiserver (no node: pods stay Pending, which is
enough for their writes): states in the order sent, by name, from now on when asked."""

from __future__ import annotations

from tests.apiserver import SharedApi
from tests.local.kube_helpers import Kube, PodRecorder
from tests.polling import wait_for


def _pod(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "recorded"}},
            "spec": {"containers": [{"name": "main", "image": "registry.invalid/none"}]}}


def _label(kube: Kube, namespace: str, name: str, value: str) -> None:
    kube.core.patch_namespaced_pod(name, namespace, {"metadata": {"labels": {"mark": value}}})


def test_states_come_in_the_order_sent_and_since_now_leaves_the_past_out(shared_api: SharedApi):
    kube = Kube(str(shared_api.kubeconfig))
    namespace = shared_api.new_namespace("recorder")
    kube.create_pod(_pod("before"), namespace)
    with PodRecorder(kube, namespace, "app=recorded") as everything:
        recorder = PodRecorder(kube, namespace, "app=recorded", since_now=True).start()
        kube.create_pod(_pod("after"), namespace)
        for value in ("one", "two"):
            _label(kube, namespace, "after", value)
            _label(kube, namespace, "before", value)
        wanted = [("after", None), ("after", "one"), ("before", "one"), ("after", "two"),
                  ("before", "two")]

        def marks() -> list[tuple[str, str | None]]:
            """Each (pod, mark) as first sent: the scheduler's writes (Unschedulable, no
            node here) come in between."""
            firsts: list[tuple[str, str | None]] = []
            for pod in recorder.order:
                mark = (pod["metadata"]["name"], pod["metadata"]["labels"].get("mark"))
                if mark not in firsts:
                    firsts.append(mark)
            return firsts
        wait_for(lambda: marks() == wanted, 30, "every change recorded")
        assert recorder.stop()[0]["metadata"]["name"] == "after"
        assert recorder.error is None
        wait_for(lambda: [p["metadata"]["labels"].get("mark")
                          for p in everything.seen.get("before", [])][-1:] == ["two"], 30,
                 "the recorder without since_now: the pod as it was, then its changes")
        assert everything.seen["before"][0]["metadata"]["labels"].get("mark") is None
    assert recorder.termination_text("after") is None
    assert everything.error is None
