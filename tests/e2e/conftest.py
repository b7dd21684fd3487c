"""The operator most end-to-end modules run: one standalone replica against the module's
`cluster` fixture. A module that needs other settings defines its own `operator`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import Cluster, OperatorProcess, running_operator


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator")) as process:
        yield process
