"""The save-on-notice deadline: when the notice came, and a save that overran the window."""

from __future__ import annotations

import os
import signal
import time

from tardigrade_checkpoint.storage import StorageRetries
from tardigrade_sdk.preemption import PreemptionWatcher, save_deadline, window_overrun


def test_the_watcher_times_the_notice_from_the_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        watcher = PreemptionWatcher()  # no jax.distributed: the Python handler stands in
        assert watcher.noticed_at is None and watcher.seconds_since_notice() == 0.0
        assert not watcher.should_stop(1)
        before = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while watcher.noticed_at is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        assert watcher.should_stop(2)
        assert watcher.noticed_at is not None and watcher.noticed_at >= before
        first = watcher.noticed_at
        watcher._on_sigterm(signal.SIGTERM, None)  # a second notice does not restart the clock
        assert watcher.noticed_at == first
        assert 0 < watcher.seconds_since_notice() <= time.monotonic() - first
        assert watcher.own_notice_at == first  # without JAX every notice is a SIGTERM of its own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_save_longer_than_the_shutdown_window_is_reported_with_the_fix():
    assert window_overrun(14.9, 15) is None
    assert window_overrun(15.0, 15) is None
    message = window_overrun(21.25, 15)
    assert message is not None
    assert "21.2s" in message and "15s" in message
    assert "spec.preemption.shutdownWindowSeconds" in message
    assert "spec.checkpoint.interval" in message


def test_the_save_deadline_is_the_window_from_the_notice_less_a_margin():
    assert save_deadline(100.0, 15).at == 113.0  # 2 s margin at most
    assert save_deadline(100.0, 5).at == 104.0  # a fifth of a short window
    assert "13.0s after the notice, of the 15s shutdown window" in save_deadline(0, 15).what


def test_storage_retries_are_cut_to_what_is_left_of_a_deadline():
    retries = StorageRetries(max_retries=8, initial_delay_seconds=0.5, max_delay_seconds=16)
    assert retries.within(600).max_retries == 8
    assert retries.within(13).max_retries == 4  # backoff 0.5 + 1 + 2 + 4 = 7.5 s (+8 > 13)
    assert retries.within(1).max_retries == 1
    assert retries.within(0).max_retries == 0


def test_a_sigterm_is_announced_to_the_gang_at_once_by_a_thread_of_its_own():
    """Not by XLA's notifier, which looks for the signal once a second: the notice key JAX's
    sync manager listens for is written by the thread the signal woke, with the time."""
    import datetime
    import os
    import signal
    import threading

    from tardigrade_sdk.preemption import NOTICE_KEY, NoticeAnnouncer

    written: list[tuple[str, str, bool]] = []
    done = threading.Event()

    class Client:
        def key_value_set(self, key: str, value: str) -> None:
            written.append((key, value, threading.current_thread() is threading.main_thread()))
            done.set()

    before = datetime.datetime.now(datetime.UTC)
    sent_at = time.monotonic()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        announcer = NoticeAnnouncer(Client())
        assert announcer.installed and announcer.received_at is None  # no SIGTERM of its own
        os.kill(os.getpid(), signal.SIGTERM)
        assert done.wait(30), "no notice written"
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(-1)
    [(key, value, on_main_thread)] = written
    # The process knows the SIGTERM was its own, not a peer's (inplace.release_deadline).
    assert announcer.received_at is not None and sent_at <= announcer.received_at
    assert key == NOTICE_KEY and not on_main_thread
    assert before <= datetime.datetime.fromisoformat(value) <= datetime.datetime.now(datetime.UTC)
