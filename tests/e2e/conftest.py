"""The operator most end-to-end modules run against the module's `cluster` fixture: on real
nodes the chart's, installed with helm (the module's `OPERATOR_HELM_VALUES`, if it has them,
added to the install); beside a control plane without nodes one standalone replica of the
checkout's operator. A module that needs more
defines its own `operator`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.e2e.diagnostics import snapshot
from tests.e2e.harness import (
    Cluster,
    InstalledOperator,
    OperatorProcess,
    RealCluster,
    installed_operator,
    running_operator,
)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory,
             request: pytest.FixtureRequest) -> Iterator[OperatorProcess | InstalledOperator]:
    log_dir = tmp_path_factory.mktemp("operator")
    if isinstance(cluster, RealCluster):
        values = tuple(getattr(request.module, "OPERATOR_HELM_VALUES", ()))
        with installed_operator(cluster, log_dir, *values) as installed:
            yield installed
    else:
        with running_operator(cluster, log_dir) as process:
            yield process


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    """A failed end-to-end test's report shows its cluster as it was (diagnostics.py)."""
    report = yield
    if report.failed and call.when == "call":
        funcargs = getattr(item, "funcargs", {})
        cluster = funcargs.get("cluster")
        if isinstance(cluster, Cluster):
            operator = funcargs.get("operator")
            log = None
            if isinstance(operator, OperatorProcess):
                log = operator.log_path
            elif isinstance(operator, InstalledOperator):
                with contextlib.suppress(Exception):  # the cluster may be what broke
                    operator.read_log()
                log = operator.log_path
            report.sections.append(("cluster at the failure", snapshot(cluster, log)))
    return report
