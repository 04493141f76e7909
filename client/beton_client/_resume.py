"""Reconnecting to a restarted daemon: the retry policy and the position a Loader resumes from.

Exactly-once resume rests on one fact: a batch is a pure function of (dataset, pipeline spec,
seed, order, batch size, ``drop_last``, distributed settings, epoch, batch index). The client
therefore only needs its position, ``(epoch, next batch index)``, to ask a new daemon (or the same
one after a restart) for exactly the batches it has not yet yielded:

* while iterating, a lost connection (the daemon was killed or restarted) raises
  :class:`~beton_client.errors.ServerUnavailable` inside the Loader; it re-opens the stream with
  :func:`retry` under the Loader's :class:`RetryPolicy` and sends ``Start(epoch, next_batch)``;
* across a trainer restart, ``Loader.state_dict()`` / ``load_state_dict()`` carry the same
  position, in the format both Loaders share (``beton_wire.loader_state``).

A daemon that ends the stream on purpose (SIGTERM drain: ``server_error == "ShuttingDown"``) is
not retried unless :attr:`RetryPolicy.after_shutdown` is set: an operator stopped it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from beton_client.errors import ServerUnavailable, SpecError

__all__ = [
    "RetryPolicy",
    "retriable",
    "retry",
]

log = logging.getLogger("beton_client.resume")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded reconnection with exponential backoff.

    Attributes:
        budget_s: total seconds spent retrying one reconnection before giving up with
            :class:`~beton_client.errors.ServerUnavailable` (0 disables reconnection).
        initial_s: the first pause between attempts.
        max_s: the longest pause between attempts.
        multiplier: each pause is the previous one times this (at least 1).
        jitter: a fraction in [0, 1]; each pause is scaled by a random factor in
            ``[1 - jitter, 1]`` so that many clients do not reconnect in lockstep.
        after_shutdown: also reconnect when the daemon ended the stream on purpose (SIGTERM).
    """

    budget_s: float = 30.0
    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    after_shutdown: bool = False

    def __post_init__(self) -> None:
        if self.budget_s < 0 or self.initial_s <= 0 or self.max_s < self.initial_s:
            raise SpecError(
                "RetryPolicy needs budget_s >= 0 and 0 < initial_s <= max_s, got "
                f"budget_s={self.budget_s}, initial_s={self.initial_s}, max_s={self.max_s}"
            )
        if self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise SpecError(
                f"RetryPolicy needs multiplier >= 1 and 0 <= jitter <= 1, got "
                f"multiplier={self.multiplier}, jitter={self.jitter}"
            )

    def pauses(self, rng: random.Random | None = None) -> Iterator[float]:
        """The pauses between attempts (endless; :func:`retry` stops at the budget)."""
        rng = rng or random.Random()
        pause = self.initial_s
        while True:
            yield pause * (1.0 - self.jitter * rng.random())
            pause = min(self.max_s, pause * self.multiplier)


def retriable(err: BaseException, policy: RetryPolicy) -> bool:
    """Whether ``err`` means "the daemon went away": worth reconnecting under ``policy``."""
    if not isinstance(err, ServerUnavailable) or policy.budget_s <= 0:
        return False
    return policy.after_shutdown or err.server_error != "ShuttingDown"


def retry(
    attempt: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    first_error: BaseException | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Call ``attempt`` until it succeeds, retrying :func:`retriable` errors within the budget.

    Args:
        attempt: one try (e.g. re-open the stream); raises ``ServerUnavailable`` to be retried.
        policy: the budget and backoff.
        what: for logs and the final error ("reconnect to unix:///...").
        first_error: the error that made us retry (quoted when the budget runs out).
        sleep: injectable for tests.
        clock: injectable for tests.

    Returns:
        What ``attempt`` returned.

    Raises:
        ServerUnavailable: the budget ran out; the message gives the attempts, the seconds and
            the last error.
        BetonClientError: any non-retriable error from ``attempt``, unchanged.
    """
    start = clock()
    last: BaseException | None = first_error
    tries = 0
    for pause in policy.pauses():
        tries += 1
        try:
            return attempt()
        except ServerUnavailable as err:
            if not retriable(err, policy):
                raise
            last = err
        elapsed = clock() - start
        if elapsed + pause > policy.budget_s:
            break
        log.info("%s: attempt %d failed (%s); retrying in %.2f s", what, tries, last, pause)
        sleep(pause)
    message = (
        f"could not {what}: gave up after {tries} attempts in {clock() - start:.1f} s "
        f"(RetryPolicy.budget_s={policy.budget_s}); last error: {last}"
    )
    # The last error's traceback keeps this frame: holding it here would make a reference
    # cycle that keeps both (and what the attempts' frames held) until a collection.
    last = first_error = None
    raise ServerUnavailable(message, code="UNAVAILABLE") from None
