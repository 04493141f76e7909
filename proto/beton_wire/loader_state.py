"""The ``Loader.state_dict()`` format: one definition for the in-process and the served Loader.

A state is a flat ``dict`` of plain Python values (``int``, ``bool``, ``str``, ``None``), so
that ``torch.save``, JSON and pickle all carry it. Version 2 (:data:`STATE_VERSION`):

================  =========  ======================================================================
key               type       meaning
================  =========  ======================================================================
``version``       int        2
``epoch``         int        the epoch the next ``iter(loader)`` continues (0..``MAX_EPOCH``)
``batch``         int        batches of that epoch already yielded (0 <= batch < ``len``)
``seed``          int        the Loader's ``seed``
``order``         str        the order's name: ``"SEQUENTIAL"``, ``"RANDOM"``, ``"QUASI_RANDOM"``,
                             or ``module.QualName`` of a custom ``TraversalOrder``
``batch_size``    int        ``batch_size``
``drop_last``     bool       ``drop_last``
``distributed``   bool       ``distributed``
``rank``          int        this process's rank (0 unless distributed)
``world_size``    int        the number of ranks (1 unless distributed)
``num_samples``   int        samples this rank visits per epoch: ``n``, or ``ceil(n / world_size)``
                             when distributed, where ``n`` is ``len(indices)`` or the dataset's size
``indices``       str|None   :func:`indices_digest` of ``indices``; ``None`` for ``indices=None``
``len``           int        batches per epoch (``len(loader)``)
``dataset``       str|None   the dataset's files by content
                             (:func:`beton_wire.file_identity.dataset_digest`); ``None`` when the
                             Loader could not tell. Optional: a state without it is not checked on it
================  =========  ======================================================================

The ``dataset`` digest starts with its scheme (``"v2:"``). One saved by a beton-serve whose
digests hashed only the files' ends (no prefix) cannot be compared with this version's
(:func:`beton_wire.file_identity.compare_digests`): such a state resumes, unchecked on
``dataset``, and a warning says so.

**Compatibility rule.** A state resumes on any Loader, in-process or served, over any transport,
whose :class:`StateIdentity` is equal: then the rest of the epoch is bit-identical, because a batch
is a pure function of (dataset, pipelines, identity, epoch, batch index). Any difference is refused
with :class:`StateError` naming the argument; so is a state of another dataset file (the
same size and arguments, other contents), when both name theirs. Version-1 states, and the
version-less dicts some callers build by hand (``epoch``, ``batch`` and any of the keys above, or
version 1's ``num_indices``), still load: they are checked on the keys they have. A state of an
unknown version is refused, never guessed at.

Only the stdlib, numpy and ``beton_wire`` are imported: both the daemon's and the client's
packages use this module, and each translates :class:`StateError` into its own ``SpecError``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_wire.file_identity import compare_digests
from beton_wire.limits import MAX_EPOCH

_log = logging.getLogger("beton_wire")

__all__ = [
    "LEGACY_VERSIONS",
    "STATE_VERSION",
    "StateError",
    "StateIdentity",
    "check_state",
    "indices_digest",
    "make_state",
    "samples_per_rank",
]

#: The version :func:`make_state` writes.
STATE_VERSION = 2
#: Older versions :func:`check_state` still reads (``None``: a dict without ``"version"``).
LEGACY_VERSIONS: tuple[int | None, ...] = (None, 1)

#: What each identity key is called in a refusal: the Loader argument to change.
_ARGUMENT = {
    "seed": "seed",
    "order": "order",
    "batch_size": "batch_size",
    "drop_last": "drop_last",
    "distributed": "distributed",
    "rank": "rank (distributed settings: RANK / torch.distributed)",
    "world_size": "world_size (distributed settings: WORLD_SIZE / torch.distributed)",
    "num_samples": "indices (or the dataset: another number of samples)",
    "indices": "indices (the same number of samples, other ids or another order of them)",
    "len": "batches per epoch (batch_size, drop_last, indices or the dataset)",
    "dataset": "dataset: the state was saved on another file (its contents differ) or on this "
    "file before it changed",
}


class StateError(ValueError):
    """A state that cannot resume this Loader; the message says which argument differs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateIdentity:
    """Everything that must be equal for a resume to be exact (see the module docstring).

    Attributes:
        seed: the Loader's seed (``0 <= seed < 2**64``).
        order: the order's name (``OrderOption.name`` or a custom order's qualified name).
        batch_size: samples per batch.
        drop_last: whether a short last batch is dropped.
        distributed: whether the order is split over ranks.
        rank: this rank.
        world_size: the number of ranks.
        num_samples: samples this rank visits per epoch (:func:`samples_per_rank`).
        indices: :func:`indices_digest` of the subset, ``None`` for every sample.
        len: batches per epoch.
        dataset: the dataset's files by content (``dataset_digest``), ``None`` when unknown.
    """

    seed: int
    order: str
    batch_size: int
    drop_last: bool
    distributed: bool
    rank: int
    world_size: int
    num_samples: int
    indices: str | None
    len: int
    dataset: str | None = None

    def __post_init__(self) -> None:
        if self.len < 0 or self.batch_size < 1 or not 0 <= self.rank < self.world_size:
            raise StateError(
                f"invalid Loader identity: len={self.len}, batch_size={self.batch_size}, "
                f"rank={self.rank}, world_size={self.world_size}"
            )


def samples_per_rank(n: int, *, distributed: bool, world_size: int) -> int:
    """Samples one rank visits per epoch out of ``n`` selected ones (the daemon's formula)."""
    if distributed:
        return -(-int(n) // int(world_size))
    return int(n)


def batch_rows(batch_size: int, num_samples: int) -> int:
    """The most samples one batch holds when an epoch visits ``num_samples`` (at least 1).

    Batch buffers, plans and rings are sized for this, not for ``batch_size``: a batch size
    far above the epoch (a small validation set at a training batch size, or an absurd
    request) allocates only what its one batch can hold. Batching itself (``len``,
    ``drop_last``, QUASI_RANDOM's windows) still uses ``batch_size``.
    """
    return max(1, min(int(batch_size), int(num_samples)))


def indices_digest(indices: Sequence[int] | NDArray[Any] | None) -> str | None:
    """A fingerprint of a subset, order included: BLAKE2b-128 of the ids as little-endian uint64.

    ``None`` stays ``None`` (every sample). About 1 ms per million ids; callers cache it.
    """
    if indices is None:
        return None
    ids = np.ascontiguousarray(np.asarray(indices, dtype=np.uint64).reshape(-1), dtype="<u8")
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def make_state(*, epoch: int, batch: int, identity: StateIdentity) -> dict[str, Any]:
    """The ``state_dict()`` of a Loader that has yielded ``batch`` batches of ``epoch``.

    ``batch >= identity.len`` (an exhausted epoch) is written as the start of the next epoch.
    """
    epoch, batch = int(epoch), int(batch)
    if batch >= identity.len:
        epoch, batch = epoch + 1, 0
    state: dict[str, Any] = {"version": STATE_VERSION, "epoch": epoch, "batch": batch}
    for f in fields(identity):
        state[f.name] = getattr(identity, f.name)
    return state


def _int(state: Mapping[str, Any], key: str) -> int:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise StateError(f"Loader state {key}={value!r:.80} is not an integer")
    return int(value)


def _mismatch(key: str, theirs: Any, mine: Any) -> StateError:
    if key == "dataset":
        return StateError(
            f"Loader state has dataset={theirs!r:.80} but this Loader reads {mine!r:.80}: "
            f"the {_ARGUMENT[key]}; resume it on the file it was saved on"
        )
    hint = (
        # seed=None draws a seed per Loader (FFCV's rule): the state holds the one drawn.
        f" (pass seed={theirs!r} to resume a Loader built with seed=None)" if key == "seed" else ""
    )
    return StateError(
        f"Loader state has {key}={theirs!r:.80} but this Loader has {mine!r:.80}: the "
        f"{_ARGUMENT[key]} differs; build the Loader with the same arguments as the one that "
        f"saved the state{hint}"
    )


#: Keys a version-2 state may lack (added after version 2 was first written).
_OPTIONAL = frozenset({"dataset"})


def _check_keys(state: Mapping[str, Any], mine: StateIdentity) -> None:
    """Compare every identity key ``state`` has (an optional one only when both know it)."""
    for f in fields(mine):
        if f.name not in state:
            continue
        want = getattr(mine, f.name)
        got = state[f.name]
        if f.name == "dataset":
            if got is None or want is None:
                continue
            same = compare_digests(str(got), str(want))
            if same is None:
                _log.warning(
                    "the Loader state's dataset digest %.15s was made by another beton-serve "
                    "version than this Loader's %.15s and cannot be compared with it: the state "
                    "resumes without checking that it was saved on these files",
                    got,
                    want,
                )
                continue
        elif isinstance(want, bool):
            same = isinstance(got, bool | np.bool_) and bool(got) == want
        elif isinstance(want, int):
            same = _int(state, f.name) == want
        else:
            same = got == want
        if not same:
            raise _mismatch(f.name, got, want)


def _check_v2(state: Mapping[str, Any], mine: StateIdentity) -> None:
    missing = [f.name for f in fields(mine) if f.name not in state and f.name not in _OPTIONAL]
    if missing:
        raise StateError(f"Loader state (version {STATE_VERSION}) lacks {missing}")
    _check_keys(state, mine)


def _check_legacy(state: Mapping[str, Any], mine: StateIdentity) -> None:
    # A version-less dict may carry any of version 2's keys (a checkpoint tool that dropped
    # ``version``): each one present is checked as version 2 checks it.
    _check_keys(state, mine)
    # Version 1's ``num_indices`` counted the selected samples before the distributed split;
    # only an undistributed Loader knows that number without its dataset.
    if "num_indices" in state and not mine.distributed:
        if _int(state, "num_indices") != mine.num_samples:
            raise _mismatch("num_samples", state["num_indices"], mine.num_samples)


def check_state(state: Mapping[str, Any], mine: StateIdentity) -> tuple[int, int]:
    """Validate ``state`` (any supported version) against this Loader's identity ``mine``.

    Returns:
        ``(epoch, batch)`` to resume at; ``batch == len`` is normalised to the next epoch.

    Raises:
        StateError: not a mapping, an unknown version, a missing or ill-typed key, a position
            outside the epoch, or an identity key that differs (the message names the argument).
    """
    if not isinstance(state, Mapping):
        raise StateError(f"a Loader state is a dict, not {type(state).__name__}")
    version = state.get("version")
    if version == STATE_VERSION and not isinstance(version, bool):
        _check_v2(state, mine)
    elif version in LEGACY_VERSIONS and not isinstance(version, bool):
        _check_legacy(state, mine)
    else:
        raise StateError(
            f"unknown Loader state version {version!r:.40}: this version reads "
            f"{STATE_VERSION} and the older 1 (or no version key)"
        )
    for key in ("epoch", "batch"):
        if key not in state:
            raise StateError(f"Loader state lacks {key!r}")
    epoch, batch = _int(state, "epoch"), _int(state, "batch")
    if epoch < 0 or not 0 <= batch <= mine.len:
        raise StateError(f"Loader state epoch {epoch} batch {batch} is outside 0..{mine.len}")
    if batch == mine.len:
        epoch, batch = epoch + 1, 0
    if epoch > MAX_EPOCH:
        raise StateError(
            f"Loader state epoch {epoch} is past the last epoch a Loader starts ({MAX_EPOCH})"
        )
    return epoch, batch
