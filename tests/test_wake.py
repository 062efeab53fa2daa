"""A wake-up given from any thread with one call into C, and taken by the one thread that waits for it."""

from __future__ import annotations

import threading

from dcp_otel._wake import Wake


def test_a_wake_given_before_the_wait_is_kept_once_and_taken_by_it() -> None:
    wake = Wake()
    assert not wake.is_set() and wake.wait(0) is False
    wake.set()
    wake.set()  # (a second while one is pending: still one)
    assert wake.is_set()
    assert wake.wait(0) is True  # taken
    assert wake.wait(0) is False and not wake.is_set()


def test_clear_forgets_a_pending_wake_and_a_wake_from_another_thread_ends_a_wait() -> None:
    wake = Wake()
    wake.set()
    wake.clear()
    assert wake.wait(0) is False
    waiting, woken = threading.Event(), []

    def waiter() -> None:
        waiting.set()
        woken.append(wake.wait(30))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(30)
    wake.set()
    thread.join(30)
    assert woken == [True]
