# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""A daemon with more workers than a stream has credits splits prefetched batches into slices
(``Engine.prefetch_slices``); what it serves stays equal, bit for bit, to the in-process Loader.

With ``--workers 16`` and 224-px batches of 32 (4.8 MB a slot, so a ring of 6 slots and 6
credits), each prefetched batch runs in ``ceil(16 / 6) = 3`` slices. The daemons of the other
served tests have 2 workers, where prefetched batches stay whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from beton_client import Loader, OrderOption
from beton_serve.loader import Loader as InProcessLoader
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.served_epochs import assert_same_epochs, read_epochs, rrc_pipelines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_sixteen_worker_daemon_serves_split_prefetch_equal_to_in_process(
    daemon_factory, fixtures_dir: Path
) -> None:
    beton = fixtures_dir / "images_jpg.beton"
    kw: dict[str, Any] = dict(
        batch_size=32, order=OrderOption.RANDOM, seed=11, drop_last=False, batches_ahead=3
    )
    # beton_serve's own Loader: beton_client's, given a path, would spawn a daemon of its own
    with InProcessLoader(str(beton), pipelines=rrc_pipelines(224), num_workers=1, **kw) as ref_ld:
        want = read_epochs(ref_ld, 3)
    d = daemon_factory([beton], args=["--workers", "16"])
    with Loader(
        "images_jpg", pipelines=rrc_pipelines(224), server=d.address, copy=True, **kw
    ) as ld:
        got = read_epochs(ld, 3)
    assert len(got) == len(want) >= 6
    assert_same_epochs(got, want)
