"""The client's retry policy (``beton_client._resume``), without a daemon."""

from __future__ import annotations

import pytest
from beton_client import RetryPolicy, ServerUnavailable, SpecError
from beton_client._resume import retriable, retry


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    p = RetryPolicy(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter=0.0)
    gen = p.pauses()
    assert [round(next(gen), 6) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_retry_succeeds_after_failures_and_gives_up_at_the_budget() -> None:
    clock = _Clock()
    calls = []

    def flaky() -> str:
        calls.append(clock.now)
        if len(calls) < 4:
            raise ServerUnavailable("down")
        return "ok"

    p = RetryPolicy(budget_s=10, initial_s=0.5, max_s=4, jitter=0.0)
    assert retry(flaky, p, what="x", sleep=clock.sleep, clock=clock) == "ok"
    assert clock.sleeps == [0.5, 1.0, 2.0]

    clock2 = _Clock()

    def never() -> None:
        raise ServerUnavailable("still down")

    with pytest.raises(ServerUnavailable, match=r"gave up after .* attempts") as info:
        retry(never, p, what="reconnect", sleep=clock2.sleep, clock=clock2)
    assert "still down" in str(info.value)
    assert clock2.now <= 10  # never sleeps past the budget


def test_non_retriable_errors_pass_through_and_shutdown_is_not_retried_by_default() -> None:
    p = RetryPolicy()
    with pytest.raises(SpecError):
        retry(lambda: (_ for _ in ()).throw(SpecError("bad")), p, what="x")
    drained = ServerUnavailable("bye", server_error="ShuttingDown")
    assert not retriable(drained, p)
    assert retriable(drained, RetryPolicy(after_shutdown=True))
    assert retriable(ServerUnavailable("lost"), p)
    assert not retriable(ServerUnavailable("lost"), RetryPolicy(budget_s=0))


def test_invalid_policies_are_refused() -> None:
    with pytest.raises(SpecError):
        RetryPolicy(initial_s=0)
    with pytest.raises(SpecError):
        RetryPolicy(multiplier=0.5)
