"""`python -m tardigrade_local.apiserver --port P --state-dir D [--crds DIR] [--kubeconfig F]`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from .featuregates import FeatureGates
from .server import ApiServer


async def _serve(args: argparse.Namespace) -> None:
    server = ApiServer(host=args.host, port=args.port, state_dir=args.state_dir,
                       crd_paths=args.crds, bookmark_interval=args.bookmark_interval,
                       access_log=args.access_log,
                       authorization_mode=args.authorization_mode, audit_log=args.audit_log,
                       feature_gates=FeatureGates.parse(args.feature_gates))
    await server.start()
    if args.kubeconfig:
        server.write_kubeconfig(args.kubeconfig)
    # One line on stdout tells a parent process the server is up and where.
    print(f"listening on {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tardigrade_local.apiserver")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--crds", action="append", default=[],
                        help="CRD file or directory to register at start (repeatable)")
    parser.add_argument("--kubeconfig", default=None, help="write a kubeconfig here")
    parser.add_argument("--bookmark-interval", type=float, default=10.0)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--access-log", action="store_true",
                        help="log every request (at INFO; use with --log-level INFO)")
    parser.add_argument("--authorization-mode", default="AlwaysAllow",
                        choices=["AlwaysAllow", "RBAC"])
    parser.add_argument("--audit-log", default=None,
                        help="append one JSON line per authorization decision to this file")
    parser.add_argument("--feature-gates", default="",
                        help="Name=true|false,... (ContainerRestartRules, "
                             "RestartAllContainersOnContainerExits)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
