"""Reconnecting to a restarted daemon: the retry policy and the position a Loader resumes from.

Exactly-once resume rests on one fact: a batch is a pure function of (dataset, pipeline spec,
seed, order, batch size, ``drop_last``, distributed settings, epoch, batch index). The client
therefore only needs its position, ``(epoch, next batch index)``, to ask a new daemon (or the same
one after a restart) for exactly the batches it has not yet yielded:

* while iterating, a lost connection (the daemon was killed or restarted) raises
  :class:`~beton_client.errors.ServerUnavailable` inside the Loader; it re-opens the stream with
  :func:`retry` under the Loader's :class:`RetryPolicy` and sends ``Start(epoch, next_batch)``;
* across a trainer restart, ``Loader.state_dict()`` / ``load_state_dict()`` carry the same
  position (:func:`make_state` / :func:`check_state`).

A daemon that ends the stream on purpose (SIGTERM drain: ``server_error == "ShuttingDown"``) is
not retried unless :attr:`RetryPolicy.after_shutdown` is set: an operator stopped it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from beton_client.errors import ServerUnavailable, SpecError

__all__ = [
    "STATE_VERSION",
    "RetryPolicy",
    "check_state",
    "make_state",
    "retriable",
    "retry",
]

log = logging.getLogger("beton_client.resume")

T = TypeVar("T")

#: Version of the ``Loader.state_dict()`` format (the same keys as ``beton_serve.loader``'s).
STATE_VERSION = 1


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
    raise ServerUnavailable(
        f"could not {what}: gave up after {tries} attempts in {clock() - start:.1f} s "
        f"(RetryPolicy.budget_s={policy.budget_s}); last error: {last}",
        code="UNAVAILABLE",
    ) from None


def make_state(
    *,
    epoch: int,
    batch: int,
    seed: int,
    length: int,
    rank: int,
    world_size: int,
    num_indices: int | None,
) -> dict[str, Any]:
    """The ``state_dict()`` of a Loader positioned at ``(epoch, batch)`` (batches yielded).

    ``num_indices`` is left out when unknown (a served Loader over all samples).
    """
    if batch >= length:  # an exhausted epoch: point at the start of the next one
        epoch, batch = epoch + 1, 0
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "batch": int(batch),
        "seed": int(seed),
        "len": int(length),
        "rank": int(rank),
        "world_size": int(world_size),
    }
    if num_indices is not None:
        state["num_indices"] = int(num_indices)
    return state


def check_state(state: Mapping[str, Any], mine: Mapping[str, Any]) -> tuple[int, int]:
    """Validate ``state`` against this Loader's own ``mine`` (a :func:`make_state` dict).

    Returns:
        ``(epoch, batch)`` to resume at (``batch == len`` is normalised to the next epoch).

    Raises:
        SpecError: another version, seed, length, index count, rank or world size.
    """
    if state.get("version") != STATE_VERSION:
        raise SpecError(f"unknown Loader state version {state.get('version')!r}")
    for key in ("seed", "len", "num_indices", "rank", "world_size"):
        if key in state and key in mine and int(state[key]) != int(mine[key]):
            raise SpecError(
                f"Loader state has {key}={state[key]!r} but this Loader has {mine[key]!r}; "
                "build the Loader with the same arguments"
            )
    epoch, batch = int(state["epoch"]), int(state["batch"])
    length = int(mine["len"])
    if epoch < 0 or not 0 <= batch <= length:
        raise SpecError(f"Loader state epoch {epoch} batch {batch} is outside 0..{length}")
    if batch == length:
        epoch, batch = epoch + 1, 0
    return epoch, batch
