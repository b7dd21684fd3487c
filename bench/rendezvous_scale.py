"""Rank 0's rendezvous at a thousand ranks: how long until every rank is told "go".

    python bench/rendezvous_scale.py [--ranks 64,256,1024] [--review-ms 5] [--api]

Every start of a gang (every recovery) meets at rank 0's rendezvous (distributed.py), which
checks each rank's hello with a TokenReview (peerauth.py). Ranks are threads of this process
speaking the real protocol over loopback to the real `_serve_rendezvous`; the review is a
stand-in that sleeps --review-ms (a TokenReview round trip to the API server: not measured on
GKE here, said so in the output). Two arms in the same run, per gang size:
  * one at a time: `REVIEW_CONCURRENCY = 1`, how rank 0 reviewed hellos before (the baseline);
  * concurrent: the shipped `REVIEW_CONCURRENCY` reviews at once.
With --api it also times TokenReviews against the local cluster's kube-apiserver, over TLS
with a ServiceAccount token as rank 0 asks in a pod: a connection per review (how rank 0
asked before, a TLS handshake each) against one kept connection (`peerauth.KeptConnections`).

Target: a rendezvous of 1,024 ranks completes (before this bench's change, rank 0 watched its
connections with select(2), which cannot watch a descriptor numbered 1,024 or more: it failed
with "filedescriptor out of range in select()") and the concurrent arm is at most 0.2x the
one-at-a-time arm's time at 1,024 ranks.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="64,256,1024")
    parser.add_argument("--review-ms", type=float, default=5.0)
    parser.add_argument("--api", action="store_true",
                        help="also time TokenReviews against the local cluster's API server")
    return parser.parse_args()


def meet(n: int, review_seconds: float) -> float:
    """Seconds from the first hello to the last rank's "go", for a gang of `n`."""
    from tardigrade_local.ports import free_port
    from tardigrade_sdk import distributed

    def check(hello: dict, rank: int) -> str | None:
        time.sleep(review_seconds)
        return None

    port = free_port()
    served: list[object] = []

    def serve() -> None:
        try:
            distributed._serve_rendezvous(
                port, {"job": "job", "attempt": 0, "num_processes": n}, n,
                time.monotonic() + 600, check)
            served.append("ok")
        except Exception as err:
            served.append(err)

    coordinator = threading.Thread(target=serve, daemon=True)
    coordinator.start()
    # Timed from a listening rank 0: a rank that knocks earlier is refused and tries again
    # 0.2 s later, which would measure this bench's start, not the rendezvous.
    if not distributed.wait_for_listener(f"127.0.0.1:{port}", time.monotonic() + 30):
        raise SystemExit("rank 0's rendezvous did not listen within 30 s")
    failures: list[object] = []

    def join(rank: int) -> None:
        try:
            distributed._join_rendezvous(
                "127.0.0.1", port, {"job": "job", "attempt": 0, "num_processes": n,
                                    "process_id": rank, "token": "t"},
                time.monotonic() + 600)
        except Exception as err:
            failures.append(err)

    began = time.perf_counter()
    ranks = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in range(1, n)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    coordinator.join()
    seconds = time.perf_counter() - began
    if served != ["ok"] or failures:
        raise SystemExit(f"{n} ranks did not meet: rank 0 {served}, others {failures[:3]}")
    return seconds


def api_reviews(count: int = 300) -> tuple[float, float]:
    """Milliseconds per TokenReview: a connection each, then one kept connection."""
    import tempfile

    from tardigrade_local.cluster import LocalCluster
    from tardigrade_sdk import peerauth

    with tempfile.TemporaryDirectory() as state, \
            LocalCluster(Path(state) / "cluster", nodes=[], with_gcs=False,
                         api_proxy=False) as cluster:
        # Rank 0 reviews with its pod's ServiceAccount token, over TLS, as in a cluster.
        access = peerauth._from_kubeconfig(cluster.service_account_kubeconfig(
            "default", "reviewer", Path(state) / "reviewer.kubeconfig"))
        kept = peerauth.KeptConnections(access)
        timed = []
        for post in (None, kept.post):
            began = time.perf_counter()
            for _ in range(count):
                peerauth.review(access, "not-a-token", post=post)
            timed.append((time.perf_counter() - began) / count * 1000)
        return timed[0], timed[1]


def main() -> int:
    args = parse_args()
    for path in ("trainer_image", "local_cluster"):
        sys.path.insert(0, str(ROOT / path))
    from tardigrade_sdk import distributed

    # Both ends of every connection live in this process.
    sizes = [int(n) for n in args.ranks.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * max(sizes) + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    print(f"review: a {args.review_ms:g} ms sleep standing in for a TokenReview round trip "
          "(not measured on a real API server)")
    shipped = distributed.REVIEW_CONCURRENCY
    print("| ranks | one at a time s | concurrent s | concurrent / one at a time |")
    print("|---|---|---|---|")
    ratios = {}
    for n in sizes:
        distributed.REVIEW_CONCURRENCY = 1
        serial = meet(n, args.review_ms / 1000)
        distributed.REVIEW_CONCURRENCY = shipped
        concurrent = meet(n, args.review_ms / 1000)
        ratios[n] = concurrent / serial
        print(f"| {n} | {serial:.2f} | {concurrent:.2f} | {ratios[n]:.2f} |")
    if 1024 in ratios:
        verdict = "met" if ratios[1024] <= TARGET_RATIO else "MISSED"
        print(f"target: 1,024 ranks meet, concurrent <= {TARGET_RATIO} x one at a time: "
              f"{ratios[1024]:.2f} x -> {verdict}")
    else:
        print("target: not judged (no gang of 1,024 ranks in --ranks)")
    if args.api:
        fresh, kept = api_reviews()
        print(f"TokenReview on the local kube-apiserver (TLS): {fresh:.2f} ms with a "
              f"connection each, {kept:.2f} ms over a kept one ({kept / fresh:.2f} x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
