"""Bounded retries for object storage, and telling storage outages from corrupt data.

TensorStore's gcs driver retries 429/5xx answers and transport errors with exponential
backoff (`gcs_request_retries`); a stalled request is cut by curl's low-speed timeout, which
TensorStore only takes from the environment. Both are set explicitly here so that a save or
restore against an unhealthy bucket ends in a clear error within a known bound instead of
hanging, and the bound is written down next to the settings that make it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from tardigrade_contract import contract

# Status codes (absl) in TensorStore errors that mean "storage did not answer well", as
# opposed to DATA_LOSS, NOT_FOUND, INVALID_ARGUMENT, ... about the bytes themselves.
_UNAVAILABLE = re.compile(
    r"\b(UNAVAILABLE|ABORTED|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|CANCELLED|UNAUTHENTICATED|"
    r"PERMISSION_DENIED)\b"
)
ENV_LOW_SPEED_TIME = "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"
ENV_LOW_SPEED_LIMIT = "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"


@dataclasses.dataclass(frozen=True)
class StorageRetries:
    """How hard one request to object storage is tried before the save or restore fails.

    A request that receives fewer than `stall_bytes_per_second` for `stall_seconds` is cut
    and counts as a failed attempt. Worst case for one request: see `request_bound_seconds`.
    """

    max_retries: int = contract.DEFAULT_STORAGE_RETRIES
    initial_delay_seconds: float = 0.5
    max_delay_seconds: float = 16.0
    stall_seconds: int = contract.DEFAULT_STORAGE_STALL_SECONDS
    stall_bytes_per_second: int = 1

    def context_spec(self) -> dict[str, Any]:
        return {
            "gcs_request_retries": {
                "max_retries": self.max_retries,
                "initial_delay": f"{self.initial_delay_seconds}s",
                "max_delay": f"{self.max_delay_seconds}s",
            }
        }

    def request_bound_seconds(self) -> float:
        """Upper bound on one request's time before it fails for good (all attempts stall)."""
        attempts = self.max_retries + 1
        # curl samples the transfer speed about once a second: the cut comes up to ~2 s late.
        per_attempt = self.stall_seconds + 2
        backoff = sum(min(self.max_delay_seconds, self.initial_delay_seconds * 2**i)
                      for i in range(self.max_retries))
        return attempts * per_attempt + backoff

    def within(self, seconds: float) -> StorageRetries:
        """These retries, cut so that their backoff alone fits in `seconds` (a deadline's rest).

        Beyond the backoff, the deadline itself bounds each wait: a retry that could not
        finish in time would only delay the clear failure.
        """
        retries = 0
        while retries < self.max_retries and self._backoff(retries + 1) <= seconds:
            retries += 1
        return dataclasses.replace(self, max_retries=retries)

    def _backoff(self, retries: int) -> float:
        return sum(min(self.max_delay_seconds, self.initial_delay_seconds * 2**i)
                   for i in range(retries))

    def apply_stall_timeout(self) -> None:
        """Put the stall cut into the environment TensorStore's HTTP transport reads.

        An operator-set value wins. It must happen before the process's first HTTP request.
        """
        os.environ.setdefault(ENV_LOW_SPEED_TIME, str(self.stall_seconds))
        os.environ.setdefault(ENV_LOW_SPEED_LIMIT, str(self.stall_bytes_per_second))


def is_unavailable(err: BaseException) -> bool:
    """True if a TensorStore error says storage failed to serve, not that data is bad."""
    return bool(_UNAVAILABLE.search(str(err)))
