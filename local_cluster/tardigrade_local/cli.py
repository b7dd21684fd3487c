"""`tardigrade local ...`: start, disrupt and stop the local cluster."""

from __future__ import annotations

import typer

app = typer.Typer(help="Run a local Kubernetes (API server + process kubelet + GCS emulator).")
