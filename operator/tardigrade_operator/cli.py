"""The `tardigrade` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tardigrade_local.cli import app as local_app

app = typer.Typer(help="Tardigrade: keep JAX training jobs alive on preemptible capacity.",
                  no_args_is_help=True)
app.add_typer(local_app, name="local")


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
