"""The observation's reads of the cluster (observe.ClusterReader): the API server through the
operator's client, off the event loop, and rank 0's progress endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp

from tardigrade_operator.apply.kube import ClusterWriter
from tardigrade_operator.decision import queueing
from tardigrade_operator.observation.pods import PodView
from tardigrade_operator.observation.progress import Progress, fetch_progress


class KubeReader:
    def __init__(self, writer: ClusterWriter, session: aiohttp.ClientSession,
                 progress_timeout: float) -> None:
        self.writer, self.session, self.progress_timeout = writer, session, progress_timeout

    async def list_job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.writer.list_job_pods, namespace, job)

    async def read_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.writer.read_service, namespace, name)

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.writer.read_secret, namespace, name)

    async def list_scale_up_events(self, namespace: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.writer.list_scale_up_events, namespace)

    async def kueue_api(self) -> queueing.KueueApi:
        return await asyncio.to_thread(self.writer.kueue_api)

    async def fetch_progress(self, gang: Sequence[PodView], token: str | None) -> Progress:
        return await fetch_progress(self.session, list(gang), self.progress_timeout, token=token)
