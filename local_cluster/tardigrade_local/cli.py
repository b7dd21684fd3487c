"""`tardigrade local ...`: start, disrupt and stop the local cluster."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import typer

from tardigrade_local import realcluster
from tardigrade_local.cluster import ClusterError, LocalCluster, simulated_nodes
from tardigrade_local.kueue import WaitForPodsReady
from tardigrade_local.paths import StateLayout, project_python_path

app = typer.Typer(help="Run a local Kubernetes: the real control plane, real nodes (the real "
                  "kubelet and containerd), a registry, GCS emulator and the operator.")

StateDir = typer.Option(None, "--state-dir", "-d", envvar="TARDIGRADE_LOCAL_STATE_DIR",
                        help="Where the cluster keeps its state [default: .tardigrade/local].")
LabelOption = typer.Option(None, "--label", "-l", help="KEY=VALUE, repeatable.")
OperatorSetOption = typer.Option(
    None, "--operator-set", help="A `helm install --set` value for the operator's release "
    "(e.g. operator.restartInPlace=true), repeatable.")
# A cold start builds the operator and trainer images (many minutes); a warm one takes about
# a minute.
REAL_START_TIMEOUT_SECONDS = 3600.0


def _layout(state_dir: Path | None) -> StateLayout:
    return StateLayout.default() if state_dir is None else StateLayout(state_dir.absolute())


def _attach(state_dir: Path | None) -> LocalCluster:
    root = _layout(state_dir).root
    if realcluster.is_served(root):
        # A real-node cluster (`up`): its control plane's own state directory.
        root = root / "control"
    try:
        return LocalCluster.attach(root)
    except ClusterError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


@app.command()
def up(
    nodes: int | None = typer.Option(None, "--nodes", "-n", min=0,
                                     help="Ordinary real nodes (1 unless given)."),
    spot_nodes: int | None = typer.Option(
        None, "--spot-nodes", min=0, help="Real nodes labelled cloud.google.com/gke-spot=true."),
    simulated: int = typer.Option(
        0, "--simulated-nodes", min=0,
        help="For benches only: the control plane with this many simulated nodes instead of "
        "real ones, whose pods run no process (local_cluster/README.md, \"The simulator\")."),
    state_dir: Path | None = StateDir,
    foreground: bool = typer.Option(False, "--foreground/--background",
                                    help="Stay attached; Ctrl-C stops the cluster."),
    gcs: bool = typer.Option(True, "--gcs/--no-gcs", help="Start the GCS emulator (with the "
                             "Service kube-system/fake-gcs for pods)."),
    operator: bool = typer.Option(True, "--operator/--no-operator",
                                  help="Install the Tardigrade operator (helm, the chart)."),
    kueue: bool = typer.Option(
        False, "--kueue/--no-kueue",
        help="Build (first time: minutes) and run Kueue's manager (the pinned v0.19.2, or "
        "$TARDIGRADE_KUEUE_MODULE=kueue-v0.17), with its CRDs and webhooks, configured for "
        "TrainingJobs (local_cluster/README.md, \"Kueue\")."),
    kueue_pods_ready_timeout: float = typer.Option(
        0.0, min=0, help="Kueue's waitForPodsReady timeout in seconds (recovery timeout the "
        "same); 0: Kueue's default (30 min from v0.19, off before)."),
    operator_set: list[str] | None = OperatorSetOption,
    tpu_slices: int = typer.Option(
        0, min=0, help="Spot multi-host TPU slice node pools (tpu-slice-1, ...), each host a "
        "real node advertising its chips (google.com/tpu, taint google.com/tpu=present); "
        "`preempt`, `halt` and `maintenance` of a host take its whole slice, as GKE does."),
    tpu_slice_shape: str = typer.Option(
        realcluster.DEFAULT_SLICE_SHAPE, help="ACCELERATOR:TOPOLOGY:CHIPS_PER_HOST of each "
        "TPU slice (the topology's chips over chips per host: hosts a slice)."),
) -> None:
    """Start the cluster and print the `export KUBECONFIG=...` line: real nodes, each the real
    kubelet and containerd in its own network namespace, with a cluster network, DNS, an
    image registry and the operator installed with helm from the chart (Linux, root;
    local_cluster/README.md, "Real nodes")."""
    layout = _layout(state_dir)
    if simulated:
        given = [flag for flag, value in (("--nodes", nodes), ("--spot-nodes", spot_nodes),
                                          ("--operator-set", operator_set),
                                          ("--tpu-slices", tpu_slices)) if value]
        if given:
            typer.echo(f"error: {', '.join(given)}: not with --simulated-nodes (a bench's "
                       f"cluster has simulated nodes only, and runs the checkout's operator); "
                       f"leave {' and '.join(given)} out", err=True)
            raise typer.Exit(2)
        _up_simulated(layout, simulated, operator, foreground, gcs, kueue,
                      kueue_pods_ready_timeout)
        return
    config = realcluster.ServeConfig(
        nodes=1 if nodes is None else nodes, spot_nodes=spot_nodes or 0, operator=operator,
        gcs=gcs, helm_values=tuple(arg for value in operator_set or [] for arg in ("--set", value)),
        kueue=kueue, kueue_pods_ready_timeout=kueue_pods_ready_timeout, tpu_slices=tpu_slices,
        tpu_slice_shape=tpu_slice_shape)
    _up_real(layout, config, foreground)


def _up_simulated(layout: StateLayout, count: int, operator: bool, foreground: bool,
                  gcs: bool, kueue: bool, kueue_pods_ready_timeout: float) -> None:
    """The control plane with simulated nodes (benches only), the operator of this checkout
    beside it."""
    if (pid := realcluster.served_pid(layout.root)) is not None:
        typer.echo(f"error: a real-node cluster is already running in {layout.root} (pid "
                   f"{pid}); run `tardigrade local down` first", err=True)
        raise typer.Exit(1)
    if realcluster.is_served(layout.root):
        # What a killed real-node cluster left, before its directory is reused.
        realcluster.clear_state(layout.root)
    cluster = LocalCluster(layout.root, nodes=simulated_nodes(count), with_gcs=gcs,
                           remove_on_exit=True, detach=not foreground,
                           operator_command=checkout_operator() if operator else None,
                           kueue=kueue,
                           kueue_wait_for_pods_ready=WaitForPodsReady(kueue_pods_ready_timeout)
                           if kueue_pods_ready_timeout else None)
    try:
        cluster.start()
    except ClusterError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
    if not foreground:
        return
    _until_stopped("# local cluster with simulated nodes running; Ctrl-C stops it")
    cluster.stop()


def checkout_operator() -> list[str]:
    """The operator of this checkout (one standalone replica, all namespaces, metrics off so
    that two clusters' operators do not collide), as the benches run it."""
    path = os.pathsep.join(project_python_path())
    return ["env", "TARDIGRADE_METRICS_PORT=0", f"PYTHONPATH={path}", sys.executable, "-m",
            "tardigrade_operator.cli", "operator", "run", "--all-namespaces", "--standalone",
            "--health-port", "0"]


def _up_real(layout: StateLayout, config: realcluster.ServeConfig, foreground: bool) -> None:
    try:
        plan = config.plan()
    except ValueError as err:
        typer.echo(f"error: --tpu-slice-shape: {err}", err=True)
        raise typer.Exit(2) from None
    if not plan:
        typer.echo("error: --nodes/--spot-nodes/--tpu-slices: a real-node cluster needs at "
                   "least one node", err=True)
        raise typer.Exit(2)
    if config.operator and config.nodes == 0:
        typer.echo("error: --nodes: the chart keeps the operator off spot nodes; give at least "
                   "one ordinary node (--nodes 1) or --no-operator", err=True)
        raise typer.Exit(2)
    try:
        # Progress (the cluster's log) on stderr; the export line alone on stdout.
        info = realcluster.start_served(layout.root, config, REAL_START_TIMEOUT_SECONDS,
                                        progress=sys.stderr)
    except realcluster.RealClusterError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"export KUBECONFIG={shlex.quote(str(info['kubeconfig']))}")
    if not foreground:
        return
    _until_stopped("# real-node cluster running; Ctrl-C stops it")
    realcluster.stop_served(layout.root)


def _until_stopped(banner: str) -> None:
    """For `up --foreground`: wait for Ctrl-C or SIGTERM."""
    typer.echo(banner, err=True)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()


@app.command()
def down(state_dir: Path | None = StateDir) -> None:
    """Stop the cluster and every pod, and remove the state directory."""
    layout = _layout(state_dir)
    if realcluster.is_served(layout.root):
        realcluster.stop_served(layout.root)
        typer.echo(f"local cluster in {layout.root} is down")
        return
    try:
        LocalCluster.attach(layout.root).stop(remove=True)
    except ClusterError:
        # Not running: still clean up whatever a crashed cluster left.
        LocalCluster(layout.root).stop(remove=True)
    typer.echo(f"local cluster in {layout.root} is down")


@app.command()
def preempt(
    target: str = typer.Argument(
        ..., help="A node, or a pod ([NAMESPACE/]NAME) whose node to reclaim."),
    namespace: str = typer.Option("default", "--namespace", "-n"),
    grace: float | None = typer.Option(None, help="Grace seconds [default: the cluster's]."),
    replace_after: float | None = typer.Option(
        None, help="Bring the node back after this many seconds [default: the cluster's, "
        "set by `local up --replace-after/--no-replace`]."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Return when the node is gone."),
    state_dir: Path | None = StateDir,
) -> None:
    """Spot reclaim: SIGTERM, grace, SIGKILL, the Node disappears; its pool recreates it."""
    cluster = _attach(state_dir)
    nodes = {n["name"] for n in cluster.status()["nodes"]}
    real = _real_info(state_dir)
    if real is not None:
        # GKE's spot reclaim of a real node: its VM shuts down (the kubelet's graceful node
        # shutdown, its own grace), then its Node goes; it does not come back.
        given = [flag for flag, value in (("--grace", grace), ("--replace-after", replace_after))
                 if value is not None]
        if given:
            typer.echo(f"error: {', '.join(given)}: not on real nodes: a real node's grace is "
                       f"its kubelet's shutdownGracePeriod and it is not recreated; leave "
                       f"{' and '.join(given)} out", err=True)
            raise typer.Exit(2)
        nodes |= {n["name"] for n in real.get("nodes", [])}
    if target in nodes:
        cluster.preempt_node(target, grace, replace_after, wait)
        typer.echo(f"node/{target} preempted")
    else:
        ns, _, name = target.rpartition("/")
        node = cluster.preempt_pod(ns or namespace, name, grace, replace_after, wait)
        typer.echo(f"node/{node} (running pod {ns or namespace}/{name}) preempted")


def _real_info(state_dir: Path | None) -> dict[str, Any] | None:
    """What `up` started there, or None for a cluster of simulated nodes
    (`up --simulated-nodes`)."""
    root = _layout(state_dir).root
    return realcluster.read_info(root) if realcluster.is_served(root) else None


def _simulated_only(command: str, state_dir: Path | None) -> LocalCluster:
    """The cluster of `up --simulated-nodes`, for what only simulated nodes do."""
    if _real_info(state_dir) is not None:
        typer.echo(f"error: {command}: only on simulated nodes (`up --simulated-nodes`, "
                   f"benches); on real nodes use preempt, halt or maintenance", err=True)
        raise typer.Exit(2)
    return _attach(state_dir)


@app.command("delete-node")
def delete_node(node: str, state_dir: Path | None = StateDir) -> None:
    """Simulated nodes only: node lost, its pods die at once and the Node object is
    deleted."""
    _simulated_only("delete-node", state_dir).delete_node(node)
    typer.echo(f"node/{node} lost")


@app.command()
def halt(
    node: str,
    back_after: float | None = typer.Option(
        None, help="The VM boots again under the same name after this many seconds "
        "(default: it does not come back)."),
    wait: bool = typer.Option(False, "--wait/--no-wait",
                              help="Return once the VM is back (with --back-after)."),
    state_dir: Path | None = StateDir,
) -> None:
    """Ungraceful loss: the VM stops without a shutdown. Its processes freeze, the kubelet goes
    silent, the Node object stays: Unknown and tainted unreachable after the node monitor grace
    period, its pods deleted by taint eviction after their toleration (300 s) and Terminating
    until the node is back, deleted, or tainted node.kubernetes.io/out-of-service."""
    _attach(state_dir).halt_node(node, back_after, wait)
    typer.echo(f"node/{node} halted")


@app.command()
def partition(
    node: str,
    seconds: float = typer.Option(..., help="How long the kubelet cannot reach the API."),
    wait: bool = typer.Option(False, "--wait/--no-wait", help="Return once it is over."),
    state_dir: Path | None = StateDir,
) -> None:
    """Simulated nodes only: a NotReady flap, the node's kubelet cut off from the control
    plane (partition, kubelet restart) while its pods run on; Unknown after the node monitor
    grace period."""
    _simulated_only("partition", state_dir).partition_node(node, seconds, wait)
    typer.echo(f"node/{node} partitioned for {seconds:g}s")


@app.command()
def maintenance(
    node: str,
    in_seconds: float = typer.Option(..., "--in", min=0,
                                     help="Seconds until the maintenance starts."),
    back_after: float | None = typer.Option(
        None, help="Seconds after the shutdown until the VM is back under its name [default: "
        "the cluster's, set by `local up --replace-after/--no-replace`]."),
    state_dir: Path | None = StateDir,
) -> None:
    """Scheduled host maintenance of a GPU/TPU node, as GKE does it: the node is labelled
    cloud.google.com/scheduled-maintenance-time=<start, epoch seconds> now; at the start it is
    tainted cloud.google.com/impending-node-termination:NoSchedule and shut down, its pods
    getting their own grace period (at most 1 h), and the VM comes back under its name (a
    real node: its VM shuts down through logind and does not come
    back)."""
    cluster = _attach(state_dir)
    if _real_info(state_dir) is not None and back_after is not None:
        typer.echo("error: --back-after: not on real nodes: the process that started a real "
                   "node would have to start it again; leave --back-after out", err=True)
        raise typer.Exit(2)
    start = cluster.schedule_maintenance(node, in_seconds, back_after)
    typer.echo(f"node/{node}: host maintenance scheduled at {int(start)} "
               f"(in {in_seconds:g}s)")


@app.command("add-node")
def add_node(
    node: str,
    label: list[str] | None = LabelOption,
    state_dir: Path | None = StateDir,
) -> None:
    """Simulated nodes only: add a simulated node (e.g. a replacement VM)."""
    labels = dict(item.split("=", 1) for item in label or [])
    _simulated_only("add-node", state_dir).add_node(node, labels)
    typer.echo(f"node/{node} added")


@app.command()
def crash(
    pod: str = typer.Argument(..., help="[NAMESPACE/]NAME"),
    namespace: str = typer.Option("default", "--namespace", "-n"),
    container: str | None = typer.Option(None, "--container", "-c"),
    sig: int = typer.Option(int(signal.SIGKILL), "--signal", help="Signal number."),
    state_dir: Path | None = StateDir,
) -> None:
    """Simulated nodes only: make a pod's simulated container die on its own."""
    ns, _, name = pod.rpartition("/")
    _simulated_only("crash", state_dir).crash_pod(ns or namespace, name, container, sig)
    typer.echo(f"pod/{name} crashed")


@app.command("restart-apiserver")
def restart_apiserver(
    downtime: float = typer.Option(0.0, help="Seconds the port refuses connections."),
    keep_history: bool = typer.Option(
        False, "--keep-history", help="Let watches resume from before the restart (no 410)."),
    state_dir: Path | None = StateDir,
) -> None:
    """Restart the API server: connections drop, objects and resourceVersions survive."""
    _attach(state_dir).restart_apiserver(downtime, expire_history=not keep_history)
    typer.echo("API server restarted")


@app.command("cut-watches")
def cut_watches(
    expire_history: bool = typer.Option(
        False, "--expire-history", help="Also answer 410 Gone to watches resumed from before."),
    state_dir: Path | None = StateDir,
) -> None:
    """Drop every open watch connection at once."""
    cut = _attach(state_dir).cut_watches(expire_history)
    typer.echo(f"{cut} watch connections cut")


@app.command()
def status(state_dir: Path | None = StateDir,
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Show the API server, GCS emulator, nodes and the pods each runs."""
    cluster = _attach(state_dir)
    real = _real_info(state_dir)
    if real is not None:
        _status_real(cluster, real, as_json)
        return
    report = {"api_url": cluster.api_url, "kubeconfig": str(cluster.kubeconfig),
              "gcs_url": cluster.gcs_url, **cluster.status()}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(f"API server: {report['api_url']}\nkubeconfig: {report['kubeconfig']}")
    typer.echo(f"GCS:        {report['gcs_url'] or '-'}")
    for node in report["nodes"]:
        typer.echo(f"node {node['name']} ({node['state']}, {node['pool']}, {node['ip']}): "
                   f"{', '.join(node['pods']) or 'no pods'}")


def _status_real(cluster: LocalCluster, info: dict[str, Any], as_json: bool) -> None:
    """The real nodes as the API server sees them (Ready, the pods bound there)."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    core = client.CoreV1Api(api)
    registered = {n.metadata.name: n for n in core.list_node().items}
    pods: dict[str, list[str]] = {}
    for pod in core.list_pod_for_all_namespaces().items:
        if pod.spec.node_name:
            pods.setdefault(pod.spec.node_name, []).append(
                f"{pod.metadata.namespace}/{pod.metadata.name}")
    nodes = []
    for node in info.get("nodes", []):
        found = registered.get(node["name"])
        ready = next((c.status for c in (found.status.conditions or [])
                      if c.type == "Ready"), "Unknown") if found else None
        state = "gone" if found is None else "Ready" if ready == "True" else "NotReady"
        nodes.append({**node, "state": state, "pods": sorted(pods.get(node["name"], []))})
    report = {"api_url": cluster.api_url, "kubeconfig": info["kubeconfig"],
              "registry": info["registry"], "images": info["images"],
              "operator": info["operator"], "checkpoints": info["checkpoints"],
              "checkpoint_claim": info["checkpoint_claim"], "gcs_url": info.get("gcs_url"),
              "gcs_pod_env": info.get("gcs_pod_env"), "kueue": bool(info.get("kueue")),
              "real_nodes": True, "nodes": nodes}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(f"API server: {report['api_url']}\nkubeconfig: {report['kubeconfig']}")
    typer.echo(f"registry:   {report['registry']}")
    typer.echo(f"checkpoints: claim {report['checkpoint_claim']} -> {report['checkpoints']}")
    if report["kueue"]:
        typer.echo("Kueue:      running (its manager beside the control plane)")
    if report["gcs_url"]:
        # A real kubelet adds nothing to a pod's environment: a job's spec.env carries it.
        typer.echo(f"GCS:        {report['gcs_url']}; pods: {info['gcs_pod_url']} (a job's "
                   f"spec.env: gcs_pod_env of `status --json`)")
    for node in nodes:
        kind = "spot" if node["spot"] else "on-demand"
        typer.echo(f"real node {node['name']} ({node['state']}, {kind}, {node['ip']}): "
                   f"{', '.join(node['pods']) or 'no pods'}")


@app.command()
def ship(
    registry: str = typer.Option(
        ..., help="Where to push: a registry host with an optional port and path, e.g. "
        "us-central1-docker.pkg.dev/PROJECT/REPOSITORY, ghcr.io/ORG or localhost:5000."),
    tag: str | None = typer.Option(
        None, help="Image tag (default: the chart's appVersion); trainers get TAG-cpu, "
        "TAG-tpu, TAG-gpu."),
    accelerators: str = typer.Option(
        "cpu,tpu,gpu", help="Trainer images to ship, comma-separated (the GPU image is 6 GB)."),
    chart_version: str | None = typer.Option(
        None, help="The chart's version, SemVer (default: charts/tardigrade/Chart.yaml's)."),
    plain_http: bool = typer.Option(
        False, "--plain-http", help="The registry speaks HTTP without TLS (a local registry)."),
    local_base: bool = typer.Option(
        False, "--local-base", help="Build on a Python 3.11 base made from Debian's packages "
        "instead of python:3.11-slim from Docker Hub (docs/images.md), for a machine "
        "without Docker Hub."),
) -> None:
    """Build the operator and trainer images, push them and the Helm chart (OCI) to REGISTRY,
    and print the helm install line and the trainer images (docs/images.md, "Shipping")."""
    from tardigrade_local import imagebuild
    from tardigrade_local import ship as shipping

    try:
        plan = shipping.ShipPlan.parse(registry, tag, accelerators, chart_version, plain_http,
                                       local_base)
    except shipping.ShipInputError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    try:
        shipped = shipping.ship(plan)
    except (shipping.ShipError, imagebuild.ImageBuildError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(shipping.summary(shipped), nl=False)
