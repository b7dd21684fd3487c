"""Helpers for tests that drive a local cluster with the official clients."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import threading
from typing import Any, TypeVar

from kubernetes import client, config, watch

from tests.polling import wait_for

T = TypeVar("T")




class Kube:
    """The official Python client, returning plain dicts."""

    def __init__(self, kubeconfig: str) -> None:
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.policy = client.PolicyV1Api(self.api)

    def plain(self, obj: Any) -> dict[str, Any]:
        return self.api.sanitize_for_serialization(obj)

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        try:
            return self.plain(self.core.read_namespaced_pod(name, namespace))
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise

    def node_names(self) -> set[str]:
        return {n.metadata.name for n in self.core.list_node().items}

    def create_pod(self, body: dict[str, Any], namespace: str = "default") -> None:
        self.core.create_namespaced_pod(namespace, body)

    def wait_phase(self, name: str, phases: tuple[str, ...], timeout: float = 30.0,
                   namespace: str = "default") -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            pod = self.pod(name, namespace)
            return pod if pod and pod.get("status", {}).get("phase") in phases else None

        return wait_for(check, timeout, what=f"pod {name} in {phases}")

    def wait_gone(self, name: str, timeout: float = 30.0, namespace: str = "default") -> None:
        wait_for(lambda: self.pod(name, namespace) is None, timeout, what=f"pod {name} deleted")


def python_pod(name: str, script: str, restart: str = "Never", grace: int | None = None,
               node: str | None = None, **spec: Any) -> dict[str, Any]:
    """A pod whose single container runs a Python script on the `local/python` image."""
    container: dict[str, Any] = {"name": "main", "image": "local/python",
                                 "command": ["python", "-c", textwrap.dedent(script)]}
    container.update(spec.pop("container", {}))
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": spec.pop("labels", {})},
        "spec": {"restartPolicy": restart, "containers": [container], **spec},
    }
    if grace is not None:
        body["spec"]["terminationGracePeriodSeconds"] = grace
    if node is not None:
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return body


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return None


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["status"]["containerStatuses"][0]


def kubectl(*args: str, env: dict[str, str], timeout: float = 60) -> str:
    binary = shutil.which("kubectl")
    assert binary, "kubectl is not installed"
    done = subprocess.run([binary, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"kubectl {' '.join(args)} failed: {done.stderr}"
    return done.stdout


class PodRecorder:
    """Every state of the selected pods that the API server sends a watch: by pod name
    (`seen`) and in the order sent (`order`). The operator deletes a stopped gang's pods soon
    after it sees them (and with them their termination messages), so a poll could miss them;
    whether a pod was written before or after its container restarted shows in the order."""

    def __init__(self, kube: Kube, namespace: str, label_selector: str,
                 timeout_seconds: int | None = None, since_now: bool = False) -> None:
        """`timeout_seconds`: the watch's own end (None: when the recorder stops).
        `since_now`: only what changes after `start` (the watch from a list's version), not
        the pods' states as they were."""
        self.kube = kube
        self.namespace = namespace
        self.label_selector = label_selector
        self.timeout_seconds = timeout_seconds
        self.since_now = since_now
        self.seen: dict[str, list[dict[str, Any]]] = {}
        self.order: list[dict[str, Any]] = []
        self.error: Exception | None = None
        self._stopped = False
        self._watch = watch.Watch()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PodRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> PodRecorder:
        options: dict[str, Any] = ({} if self.timeout_seconds is None
                                   else {"timeout_seconds": self.timeout_seconds})
        if self.since_now:  # listed here, before `start` returns: nothing after it is missed
            options["resource_version"] = self.kube.core.list_namespaced_pod(
                self.namespace, label_selector=self.label_selector).metadata.resource_version
        self._thread = threading.Thread(target=self._run, args=(options,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        """Ends the watch; every state recorded, in order."""
        self._stopped = True
        self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return list(self.order)

    def _run(self, options: dict[str, Any]) -> None:
        try:
            for event in self._watch.stream(self.kube.core.list_namespaced_pod, self.namespace,
                                            label_selector=self.label_selector, **options):
                pod = self.kube.plain(event["object"])
                self.order.append(pod)
                self.seen.setdefault(pod["metadata"]["name"], []).append(pod)
        except Exception as err:  # the watch ends with the cluster: kept for a message
            if not self._stopped:
                self.error = err

    def termination_text(self, pod: str, container: str | None = None) -> str | None:
        """A container's termination message as its kubelet reported it (a kubelet's fallback
        to the log's end included), once it terminated with one."""
        for state in reversed(self.seen.get(pod, [])):
            for status in state["status"].get("containerStatuses") or []:
                terminated = (status.get("state") or {}).get("terminated")
                if (container is None or status["name"] == container) and terminated \
                        and terminated.get("message"):
                    return str(terminated["message"])
        return None

    def termination(self, pod: str) -> dict[str, Any] | None:
        """The container's termination message (JSON), once it terminated with one."""
        text = self.termination_text(pod)
        return None if text is None else dict(json.loads(text))
