"""Simulated containers: pods without processes, as kwok runs them.

kwok (kubernetes-sigs/kwok) fakes whole kubelets: it manages the nodes that carry the
annotation `kwok.x-k8s.io/node: fake` (`--manage-nodes-with-annotation-selector`, kwok docs
"Manage Nodes and Pods") and moves their pods through Stages that patch pod status
(`kustomize/stage/pod/general/`: pod-create -> Pending with ContainerCreating, pod-ready ->
Running, pod-delete). The simulator (`__init__.py`: benches only) does the same with its own
node agents, because kwok cannot run what the benches need of a pod: a Tardigrade rank that
forms a gang, serves progress and restarts in place. A simulated node
(`NodeConfig.simulated`, annotation `SIMULATED_ANNOTATION`) has pod workers (`worker.py`)
that start `SimulatedContainer`s, which cost a few kB and no process per pod.

What a simulated container does is chosen from its environment: a Tardigrade rank (the
operator contract's variables) runs as a `simgang.TrainerRank`; any other container idles until
it is signalled (like `sleep infinity` under a shell that exits on SIGTERM). Rank 0 of a gang
serves `/progress` on its pod IP and the progress port from one in-process HTTP server, so the
operator reads progress exactly as from a real trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, NoReturn

from aiohttp import web
from tardigrade_contract import contract
from tardigrade_sdk import inplace

from tardigrade_local.simulator import simgang

log = logging.getLogger(__name__)

# Process ids of simulated containers: far above any real pid_max (4194304), so that nothing
# that signals host processes by pid can hit a real one.
PID_BASE = 1 << 30


class SimulatedContainer:
    """A container the kubelet drives like a process: start, signals, exit status."""

    def __init__(self, runtime: SimulatedRuntime, env: Mapping[str, str]) -> None:
        self.runtime = runtime
        self.env = dict(env)
        self.oom_killed = False
        self._pid = next(runtime.pids)
        self._started = False
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.rank: simgang.TrainerRank | None = None

    @property
    def pid(self) -> int | None:
        return self._pid if self._started else None

    @property
    def exited(self) -> bool:
        return self._exit.done()

    async def start(self) -> int:
        if self.runtime.start_seconds > 0:
            await asyncio.sleep(self.runtime.start_seconds)
        self._started = True
        await self._run_trainer()
        return self._pid

    async def _run_trainer(self) -> None:
        """What the container's program does as it starts: a Tardigrade rank enters its world
        (the newer of env and file) and joins its gang; any other program idles."""
        try:
            # The trainer's own file reads and writes, off the event loop that runs every
            # simulated host: real hosts do them in parallel, not one after another.
            env, stale = await asyncio.to_thread(self._enter_world)
        except contract.ContractError as err:
            self._fail_config(self.env.get(contract.ENV_TERMINATION_LOG), str(err))
            return
        if env is None or self._exit.done():  # not a rank, or killed while it started
            return
        if stale is not None:
            simgang.write_termination(env.termination_log, stale.termination(env.attempt))
            self._set_exit(contract.EXIT_RESTART_IN_PLACE)
            return
        problem = simgang.checkpoint_problem(env)
        if problem is not None:
            self._fail_config(env.termination_log, problem)
            return
        self.rank = self.runtime.join(env, self.env.get(contract.ENV_POD_IP, ""),
                                      self._exited, self._replaced)

    def _replaced(self) -> None:
        """The rank restarts in process (the trainer's attempts.py): the container goes on,
        and the next attempt starts as the container's program does."""
        if self.rank is not None:
            self.runtime.rank_exited(self.rank)
        self.rank = None
        self.runtime.spawn(self._restart_in_process())

    async def _restart_in_process(self) -> None:
        if self.runtime.start_seconds > 0:
            await asyncio.sleep(self.runtime.start_seconds)
        if not self._exit.done():  # not killed meanwhile
            await self._run_trainer()

    def _enter_world(self) -> tuple[contract.TrainerEnvironment | None,
                                    inplace.StaleWorld | None]:
        """The trainer's start: its world (the newer of env and file), entered."""
        env = simgang.trainer_environment(inplace.newest_world(self.env))
        if env is None:
            return None, None
        try:
            inplace.enter_world(env)
        except inplace.StaleWorld as err:
            return env, err
        return env, None

    def _fail_config(self, path: str | None, why: str) -> None:
        if path:
            simgang.write_termination(path, contract.TerminationMessage(
                reason="ConfigError", message=why))
        self._set_exit(contract.EXIT_CONFIG_ERROR)

    def _exited(self, result: simgang.Exit) -> None:
        if self.rank is not None:
            self.runtime.rank_exited(self.rank)
        self._set_exit(result.returncode)

    def _set_exit(self, returncode: int) -> None:
        if not self._exit.done():
            self._exit.set_result(returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def signal_group(self, sig: int) -> None:
        if not self._started or self._exit.done():
            return
        if self.rank is not None:
            self.rank.deliver(sig)
        elif sig not in (signal.SIGSTOP, signal.SIGCONT):
            self._set_exit(-sig)  # an idle program: the default action ends it

    async def terminate(self, grace_seconds: float) -> None:
        if not self._started or self._exit.done():
            return
        self.signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._exit), max(grace_seconds, 0))
        except TimeoutError:
            self.signal_group(signal.SIGKILL)
            await self._exit


class ProgressEndpoints:
    """One HTTP server for every simulated rank 0: a listening socket on each one's pod IP and
    progress port (as the trainer's ProgressServer binds its pod IP), one handler."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self._sites: dict[tuple[simgang.GangKey, int], web.TCPSite] = {}
        self._by_address: dict[tuple[str, int], simgang.TrainerRank] = {}

    async def _ensure_runner(self) -> web.AppRunner:
        if self._runner is None:
            app = web.Application()
            app.router.add_get("/progress", self._progress)
            app.router.add_post(contract.RESTART_IN_PLACE_PATH, self._restart)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
        return self._runner

    @staticmethod
    def _key(rank: simgang.TrainerRank) -> tuple[simgang.GangKey, int]:
        return rank.gang.key, rank.process_id

    async def open(self, rank: simgang.TrainerRank, pod_ip: str) -> None:
        port = rank.env.progress_port
        if port is None:
            return
        runner = await self._ensure_runner()
        site = web.TCPSite(runner, pod_ip, port)
        try:
            await site.start()
        except OSError as err:
            log.warning("simulated rank 0 of %s cannot serve progress on %s:%d: %s",
                        rank.gang.key, pod_ip, port, err)
            return
        if rank.exit is not None:  # it ended while the socket was being opened
            await site.stop()
            return
        self._sites[self._key(rank)] = site
        self._by_address[(pod_ip, port)] = rank

    async def close(self, rank: simgang.TrainerRank) -> None:
        site = self._sites.pop(self._key(rank), None)
        for address, owner in list(self._by_address.items()):
            if owner is rank:
                del self._by_address[address]
        if site is not None:
            await site.stop()

    @staticmethod
    def _gone(request: web.Request) -> NoReturn:
        """A request to a rank that has left, in the moment before its listening socket is
        closed: a real trainer's sockets go with its process, so the client gets no HTTP
        answer (a 404 here made the operator take a rank that had restarted in place for one
        that refused its request). The connection is dropped unanswered."""
        if request.transport is not None:
            request.transport.abort()
        raise web.HTTPNotFound()  # not written: the connection is gone

    async def _progress(self, request: web.Request) -> web.StreamResponse:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        rank = self._by_address.get((sockname[0], sockname[1])) if sockname else None
        if rank is None or rank.exit is not None:
            self._gone(request)
        while rank.frozen and rank.exit is None:
            # A stopped process accepts connections (the kernel does) and never answers.
            await asyncio.sleep(0.5)
        if rank.exit is not None:
            raise web.HTTPServiceUnavailable()
        return web.Response(text=rank.gang.progress().to_json(), content_type="application/json")

    async def _restart(self, request: web.Request) -> web.StreamResponse:
        """The trainer's inplace.RestartRequests: the key and the world it carries, then a
        SIGTERM to the rank."""
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        rank = self._by_address.get((sockname[0], sockname[1])) if sockname else None
        if rank is None or rank.exit is not None:
            self._gone(request)
        if (request.content_length or 0) > contract.MAX_WORLD_BYTES:
            return web.Response(status=413)
        loop = asyncio.get_running_loop()
        # Answered off the event loop (it writes the world file), as each real trainer
        # answers on its own host; the notice, the SIGTERM, is delivered on the loop.
        code, why = await asyncio.to_thread(
            rank.restarts.answer, request.headers.get("Authorization"), request.query_string,
            await request.read(),
            lambda: loop.call_soon_threadsafe(rank.deliver, signal.SIGTERM))
        if code == 202:
            rank.released()
        return web.Response(status=code, text=why)

    async def stop(self) -> None:
        for site in list(self._sites.values()):
            with contextlib.suppress(Exception):
                await site.stop()
        self._sites.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class SimulatedRuntime:
    """The container runtime of simulated nodes: one per kubelet host, shared by its nodes."""

    # The scheme of the container IDs it reports (`<scheme>://<id>`, as `containerd://...`).
    scheme = "simulated"

    def __init__(self, start_seconds: float = 0.0) -> None:
        self.start_seconds = start_seconds
        self.pids = itertools.count(PID_BASE)
        self.gangs: dict[simgang.GangKey, simgang.Gang] = {}
        self.progress = ProgressEndpoints()
        # id(rank) -> its pod IP: rank 0's for /progress, every rank's with restart in place.
        self._ips: dict[int, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def container(self, env: Mapping[str, str]) -> SimulatedContainer:
        return SimulatedContainer(self, env)

    def join(self, env: contract.TrainerEnvironment, pod_ip: str,
             on_exit: Callable[[simgang.Exit], None],
             on_replace: Callable[[], None] | None = None) -> simgang.TrainerRank:
        key = simgang.gang_key(env)
        gang = self.gangs.get(key)
        if gang is None:
            gang = simgang.Gang(key, env, asyncio.get_running_loop(),
                                on_started=self._gang_started, on_ended=self._gang_ended)
            self.gangs[key] = gang
        rank = simgang.TrainerRank(gang, env, on_exit, on_replace)
        if env.process_id == 0 or env.restart_key:
            self._ips[id(rank)] = pod_ip
        gang.join(rank)
        return rank

    def _gang_started(self, gang: simgang.Gang) -> None:
        # The trainer starts its progress server once the gang has formed (session.py); with
        # restart in place every rank serves the operator's request.
        for rank in gang.ranks.values():
            if id(rank) in self._ips:
                self.spawn(self.progress.open(rank, self._ips[id(rank)]))

    def rank_exited(self, rank: simgang.TrainerRank) -> None:
        if self._ips.pop(id(rank), None) is not None:
            self.spawn(self.progress.close(rank))

    def _gang_ended(self, gang: simgang.Gang) -> None:
        if self.gangs.get(gang.key) is gang:
            del self.gangs[gang.key]

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.progress.stop()
