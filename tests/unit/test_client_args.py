"""The client Loader refuses out-of-range arguments with SpecError before it connects."""

from __future__ import annotations

import numpy as np
import pytest
from beton_client import Loader, SpecError

# Nothing listens here: a valid Loader would fail to connect, so every SpecError below must come
# from argument checking, before any network call.
NOWHERE = "unix:///nonexistent/beton-serve-test.sock"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 10**12}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 8, "batches_ahead": 0}, "batches_ahead"),
        ({"batch_size": 8, "seed": -1}, "seed"),
        ({"batch_size": 8, "seed": 2**64}, "seed"),
        ({"batch_size": 8, "indices": [0, -3]}, "indices"),
        ({"batch_size": 8, "transport": "carrier-pigeon"}, "transport"),
    ],
)
def test_bad_arguments_raise_spec_error_naming_the_argument(
    kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(SpecError, match=words):
        Loader("images_jpg", server=NOWHERE, spawn=False, **kwargs)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted_as_sizes_and_seeds() -> None:
    # Argument checks pass; the failure is then the missing daemon, not a SpecError.
    with pytest.raises(Exception) as info:
        Loader(
            "images_jpg",
            batch_size=np.int64(8),  # type: ignore[arg-type]
            seed=np.uint32(3),  # type: ignore[arg-type]
            server=NOWHERE,
            spawn=False,
            reconnect=False,
        )
    assert not isinstance(info.value, SpecError), info.value
