"""The `tardigrade` command line."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Annotated

import typer
from tardigrade_local.cli import app as local_app

app = typer.Typer(help="Tardigrade: keep JAX training jobs alive on preemptible capacity.",
                  no_args_is_help=True)
app.add_typer(local_app, name="local")


operator_app = typer.Typer(help="Run the operator.")
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
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Where to leave the PNG and table.")] = Path(),
    quick: Annotated[bool, typer.Option(help="A shorter run (for CI).")] = False,
) -> None:
    """Run a TrainingJob on a local cluster through a preemption and a resize."""
    from rich.console import Console
    from tardigrade_local.demo import DemoSettings, run_demo

    console = Console()
    result = run_demo(out, DemoSettings.quick() if quick else DemoSettings(), console)
    console.print(result.table.read_text())
    console.print(f"[bold green]Loss curve:[/] {result.plot}")
    console.print(f"[bold green]Table:[/] {result.table}")


@app.command()
def timeline(
    name: Annotated[str, typer.Argument(help="TrainingJob name.")],
    namespace: Annotated[str, typer.Option("--namespace", "-n")] = "default",
) -> None:
    """Show a TrainingJob's state and its recoveries (cause, downtime, steps lost)."""
    import kubernetes
    from rich.console import Console

    from tardigrade_operator.api import types
    from tardigrade_operator.kube import load_client_config
    from tardigrade_operator.timeline import render

    load_client_config()
    try:
        job = kubernetes.client.CustomObjectsApi().get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)
    except kubernetes.client.exceptions.ApiException as err:
        raise typer.Exit(f"cannot read trainingjob {namespace}/{name}: {err.reason}") from None
    Console().print(render(job))


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
