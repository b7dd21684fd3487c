"""The `tardigrade` command line."""

from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

# The operator image installs only the [operator] extra: nothing here may import the local
# cluster (`tardigrade_local`) or the trainer's heavy dependencies at import time.
app = typer.Typer(help="Tardigrade: keep JAX training jobs alive on preemptible capacity.",
                  no_args_is_help=True)

EXIT_MISSING_EXTRA = 2


@contextlib.contextmanager
def needs_extra(extra: str) -> Iterator[None]:
    """Turn a missing optional dependency into one line naming the extra to install."""
    try:
        yield
    except ModuleNotFoundError as err:
        typer.echo(f"error: this command needs the [{extra}] extra (module {err.name!r} is not "
                   f"installed): pip install 'tardigrade[{extra}]'", err=True)
        raise typer.Exit(EXIT_MISSING_EXTRA) from None


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tardigrade {importlib.metadata.version('tardigrade')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Tardigrade: keep JAX training jobs alive on preemptible capacity."""


# Loaded on use: a plain command that hands its arguments (--help included) to the local
# cluster's own command group, so that `tardigrade --help` works without the [local] extra.
@app.command("local", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def local(ctx: typer.Context) -> None:
    """Run a local Kubernetes: the real control plane, real nodes, GCS emulator (local extra)."""
    with needs_extra("local"):
        from tardigrade_local.cli import app as local_app
    typer.main.get_command(local_app).main(args=ctx.args, prog_name="tardigrade local")


operator_app = typer.Typer(help="Run the operator.")


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"
app.add_typer(operator_app, name="operator")


@operator_app.command("run")
def run_operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Watch this namespace (repeatable)."),
    ] = None,
    all_namespaces: Annotated[
        bool, typer.Option("--all-namespaces", "-A", help="Watch the whole cluster.")
    ] = False,
    standalone: Annotated[
        bool, typer.Option(help="Run without peering (no leader election).")
    ] = False,
    peering: Annotated[
        str, typer.Option(help="Peering object shared by the replicas that elect a leader.")
    ] = "tardigrade",
    priority: Annotated[
        int | None,
        typer.Option(help="Peering priority of this replica (highest leads; default random)."),
    ] = None,
    health_port: Annotated[
        int, typer.Option(help="Port of the /healthz liveness endpoint (0: none).")
    ] = 8080,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    log_format: Annotated[
        LogFormat,
        typer.Option(help="text, or json: one JSON object a line (kopf's JSON log format, "
                     "with the TrainingJob in `object`) for log collectors."),
    ] = LogFormat.TEXT,
) -> None:
    """Run the TrainingJob operator against the cluster in KUBECONFIG (or in-cluster)."""
    import logging

    import kopf

    import tardigrade_operator.handlers  # noqa: F401  (registers the handlers)

    if not namespace and not all_namespaces:
        raise typer.BadParameter("pass --namespace NS (repeatable) or --all-namespaces")
    if priority is None:
        # kopf pauses every replica when two share a priority: replicas must differ.
        priority = random.SystemRandom().randint(1, 2**31 - 1)
    # kopf's own formatters: in JSON, messages about a TrainingJob carry it as `object`.
    kopf.configure(verbose=verbose, log_prefix=None, log_format=(
        kopf.LogFormat.JSON if log_format is LogFormat.JSON else kopf.LogFormat.FULL))
    # cel-python traces every short-circuited sub-expression at DEBUG.
    logging.getLogger("celpy").setLevel(logging.WARNING)
    kopf.run(
        clusterwide=all_namespaces,
        namespaces=namespace or (),
        standalone=standalone,
        # Naming a peering makes kopf wait for its CRD, even in standalone mode.
        peering_name=None if standalone else peering,
        priority=priority,
        liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz" if health_port else None,
    )


@operator_app.command("release")
def release(
    deployment: Annotated[
        str, typer.Option(help="NAMESPACE/NAME of the operator's Deployment, stopped first.")
    ],
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Release pods in this namespace (repeatable)."),
    ] = None,
    all_namespaces: Annotated[
        bool, typer.Option("--all-namespaces", "-A", help="Release pods in every namespace.")
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the operator's pods to go.")
    ] = 120.0,
) -> None:
    """Before uninstalling: stop the operator, then drop its finalizer from every trainer pod
    (the chart's pre-delete hook), so that nothing waits on an operator that is gone."""
    import kubernetes

    from tardigrade_operator.apply.kube import ClusterWriter, load_client_config
    from tardigrade_operator.cli.uninstall import release_pods, stop_deployment

    if not namespace and not all_namespaces:
        raise typer.BadParameter("pass --namespace NS (repeatable) or --all-namespaces")
    home, _, name = deployment.partition("/")
    if not name:
        raise typer.BadParameter(f"--deployment must be NAMESPACE/NAME, got {deployment!r}")
    load_client_config()
    writer = ClusterWriter()
    stop_deployment(kubernetes.client.AppsV1Api(), writer.core, home, name, timeout)
    released = release_pods(writer, None if all_namespaces else namespace)
    typer.echo(f"released {len(released)} trainer pod(s)" + "".join(
        f"\n  {pod}" for pod in released))


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Where to leave the PNG and table.")] = Path(),
    quick: Annotated[bool, typer.Option(help="A shorter run (for CI).")] = False,
) -> None:
    """Run a TrainingJob on a local cluster of real nodes (real kubelet and containerd; Linux,
    root) through a spot reclaim and a resize (local extra)."""
    from rich.console import Console

    with needs_extra("local"):
        from tardigrade_local.demo import DemoSettings, run_demo

    if os.geteuid() != 0:
        typer.echo("error: the demo needs root: its nodes are real kubelets and containerd "
                   "(network namespaces, mounts, cgroups); run it as root", err=True)
        raise typer.Exit(2)
    console = Console()
    settings = DemoSettings.quick() if quick else DemoSettings()
    result = run_demo(out, settings, console)
    console.print(result.table.read_text())
    console.print(f"[bold green]Loss curve:[/] {result.plot}")
    console.print(f"[bold green]Table:[/] {result.table}")


class TimelineOutput(enum.StrEnum):
    TABLE = "table"
    JSON = "json"


@app.command()
def timeline(
    name: Annotated[str, typer.Argument(help="TrainingJob name.")],
    namespace: Annotated[
        str | None,
        typer.Option("--namespace", "-n", help="Default: the kubeconfig context's namespace."),
    ] = None,
    context: Annotated[
        str | None, typer.Option(help="kubeconfig context (default: current-context).")
    ] = None,
    kubeconfig: Annotated[
        str | None, typer.Option(help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config).")
    ] = None,
    output: Annotated[
        TimelineOutput, typer.Option("--output", "-o", help="table, or json for scripts.")
    ] = TimelineOutput.TABLE,
) -> None:
    """Show a TrainingJob's state, its recoveries (cause, downtime, steps lost) and where its
    wall time went (the goodput account)."""
    import json

    import kubernetes
    from pydantic import ValidationError
    from rich.console import Console

    from tardigrade_operator.api import types
    from tardigrade_operator.cli.timeline import as_json, render
    from tardigrade_operator.clientconfig import ClientConfigError, resolve

    try:
        target = resolve(kubeconfig=kubeconfig, context=context)
    except ClientConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    namespace = namespace or target.namespace
    try:
        job = kubernetes.client.CustomObjectsApi(target.client).get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)
    except kubernetes.client.exceptions.ApiException as err:
        typer.echo(f"error: cannot read trainingjob {namespace}/{name}: {err.status} "
                   f"{err.reason}", err=True)
        raise typer.Exit(1) from None
    try:
        if output is TimelineOutput.JSON:
            typer.echo(json.dumps(as_json(job), indent=2))
        else:
            Console().print(render(job))
    except ValidationError as err:
        # A status written by something other than this operator version (or nested beyond
        # what is read: apidecode.py): say so, not a traceback.
        fields = "; ".join(f"status.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                           for e in err.errors()[:5])
        typer.echo(f"error: trainingjob {namespace}/{name} has a status this tardigrade cannot "
                   f"read ({fields})", err=True)
        raise typer.Exit(1) from None


@app.command()
def reference(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
) -> None:
    """Print the TrainingJob field reference (Markdown) generated from the API models."""
    from tardigrade_operator.api.reference import render_reference

    text = render_reference()
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)


@app.command()
def crd(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
) -> None:
    """Print the TrainingJob CustomResourceDefinition generated from the API models."""
    from tardigrade_operator.api.crd import render_crd_yaml

    text = render_crd_yaml()
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
