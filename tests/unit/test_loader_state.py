"""The one ``state_dict`` format (``beton_wire.loader_state``): keys, versions, refusals.

The served Loader's states are checked without a daemon here by building the dicts it wrote
(version 1: no ``num_indices`` for ``indices=None``); tests/integration/test_state_cross_backend.py
takes them from a real one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.loader import Loader, OrderOption
from beton_serve.pipeline import PlanCache
from beton_wire.limits import MAX_EPOCH
from beton_wire.loader_state import (
    STATE_VERSION,
    StateError,
    StateIdentity,
    check_state,
    indices_digest,
    make_state,
    samples_per_rank,
)
from beton_wire.notice import lease_token
from helpers.fake_pipeline import AddIndex, AddOne, FakeReader

CACHE = PlanCache()


def _loader(reader=None, **kw):
    kw.setdefault("plan_cache", CACHE)
    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 1)
    kw.setdefault("seed", 7)
    kw.setdefault("order", OrderOption.RANDOM)
    kw.setdefault("pipelines", {"image": [AddOne()], "label": [AddIndex()]})
    return Loader(reader or FakeReader(n=22), **kw)


def _labels(batches) -> list[np.ndarray]:
    return [np.array(lab[:, 0]) for _img, lab in batches]


IDENT = StateIdentity(
    seed=5,
    order="RANDOM",
    batch_size=4,
    drop_last=True,
    distributed=False,
    rank=0,
    world_size=1,
    num_samples=22,
    indices=None,
    len=5,
)


# -- the format ------------------------------------------------------------------------------
def test_make_state_writes_every_key_of_version_2_as_plain_values() -> None:
    s = make_state(epoch=2, batch=3, identity=IDENT)
    assert s == {
        "version": 2,
        "epoch": 2,
        "batch": 3,
        "seed": 5,
        "order": "RANDOM",
        "batch_size": 4,
        "drop_last": True,
        "distributed": False,
        "rank": 0,
        "world_size": 1,
        "num_samples": 22,
        "indices": None,
        "len": 5,
        "dataset": None,
    }
    assert json.loads(json.dumps(s)) == s  # torch.save / JSON / pickle all carry it
    assert check_state(s, IDENT) == (2, 3)
    # an exhausted epoch is saved, and loaded, as the start of the next one
    end = make_state(epoch=2, batch=5, identity=IDENT)
    assert (end["epoch"], end["batch"]) == (3, 0)
    assert check_state({**s, "batch": 5}, IDENT) == (3, 0)


def test_indices_digest_and_samples_per_rank() -> None:
    assert indices_digest(None) is None
    a = indices_digest([3, 1, 4])
    assert a == indices_digest(np.array([3, 1, 4], dtype=np.int32))  # dtype does not matter
    assert a != indices_digest([1, 3, 4])  # the order of the subset does
    assert a != indices_digest([3, 1, 5])
    assert samples_per_rank(10, distributed=True, world_size=4) == 3
    assert samples_per_rank(10, distributed=False, world_size=4) == 10


def test_in_process_state_is_version_2_and_names_its_arguments() -> None:
    with _loader(indices=[3, 1, 4, 1, 5, 9, 2, 6], drop_last=False) as ld:
        it = iter(ld)
        next(it)
        s = ld.state_dict()
    assert s["version"] == STATE_VERSION == 2
    assert (s["epoch"], s["batch"], s["len"]) == (0, 1, 2)
    assert (s["seed"], s["order"], s["batch_size"], s["drop_last"]) == (7, "RANDOM", 4, False)
    assert (s["distributed"], s["rank"], s["world_size"], s["num_samples"]) == (False, 0, 1, 8)
    assert s["indices"] == indices_digest([3, 1, 4, 1, 5, 9, 2, 6])


# -- versions ----------------------------------------------------------------------------------
def test_served_loader_v1_state_without_num_indices_resumes_the_in_process_loader() -> None:
    """The bug: the served Loader's state (no ``num_indices``) raised KeyError here."""
    with _loader() as ref:
        want = _labels(ref)[2:]
    served_v1 = {"version": 1, "epoch": 0, "batch": 2, "seed": 7, "len": 5}
    served_v1 |= {"rank": 0, "world_size": 1}
    with _loader() as ld:
        ld.load_state_dict(served_v1)
        got = _labels(ld)
    assert len(got) == 3
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_in_process_v1_state_still_loads() -> None:
    with _loader() as ref:
        want = _labels(ref)[4:]
    old = {"version": 1, "epoch": 0, "batch": 4, "seed": 7, "len": 5, "num_indices": 22}
    old |= {"rank": 0, "world_size": 1}
    with _loader() as ld:
        ld.load_state_dict(old)
        got = _labels(ld)
        np.testing.assert_array_equal(got[0], want[0])
    with _loader(FakeReader(n=23)) as other, pytest.raises(SpecError, match=r"22.*indices"):
        other.load_state_dict(old)  # v1's num_indices is still checked (len is 5 for both)


def test_version_less_dict_loads_and_is_checked_on_its_keys() -> None:
    with _loader() as ld:
        ld.load_state_dict({"epoch": 3, "batch": 1})
        assert (ld.next_epoch, ld._resume_batch) == (3, 1)
        ld.load_state_dict({"epoch": 3, "batch": 5})  # == len: the start of the next epoch
        assert (ld.next_epoch, ld._resume_batch) == (4, 0)
        with pytest.raises(SpecError, match=r"seed=8 .* the seed differs") as info:
            ld.load_state_dict({"epoch": 0, "batch": 1, "seed": 8})
        assert str(info.value).endswith("(pass seed=8 to resume a Loader built with seed=None)")


@pytest.mark.parametrize("version", [0, 3, "2", True, 2.5])
def test_unknown_versions_are_refused(version) -> None:
    s = make_state(epoch=0, batch=1, identity=IDENT)
    with pytest.raises(StateError, match="unknown Loader state version"):
        check_state({**s, "version": version}, IDENT)


def test_malformed_states_are_refused() -> None:
    s = make_state(epoch=0, batch=1, identity=IDENT)
    with pytest.raises(StateError, match="is a dict"):
        check_state([1, 2], IDENT)  # type: ignore[arg-type]
    with pytest.raises(StateError, match=r"lacks \['order'\]"):
        check_state({k: v for k, v in s.items() if k != "order"}, IDENT)
    with pytest.raises(StateError, match="lacks 'epoch'"):
        check_state({"version": 1, "batch": 0}, IDENT)
    with pytest.raises(StateError, match="not an integer"):
        check_state({**s, "seed": "5"}, IDENT)
    with pytest.raises(StateError, match=r"outside 0\.\.5"):
        check_state({**s, "batch": 6}, IDENT)
    with pytest.raises(StateError, match="outside"):
        check_state({**s, "epoch": -1}, IDENT)


def test_epochs_past_max_epoch_are_refused() -> None:
    """Epochs from 2**63 on (the daemon's 64-bit arithmetic overflowed: an "internal error",
    and a ``ValueError`` from protobuf past 2**64) are refused by name, for every backend
    alike; the last epoch a Loader starts is ``MAX_EPOCH``, also after a finished epoch."""
    s = make_state(epoch=0, batch=1, identity=IDENT)
    assert check_state({**s, "epoch": MAX_EPOCH}, IDENT) == (MAX_EPOCH, 1)
    for epoch in (MAX_EPOCH + 1, 2**63, 2**64, 10**30):
        with pytest.raises(StateError, match=f"epoch {epoch} is past the last epoch"):
            check_state({**s, "epoch": epoch}, IDENT)
    with pytest.raises(StateError, match="past the last epoch"):  # batch == len: the next one
        check_state({**s, "epoch": MAX_EPOCH, "batch": IDENT.len}, IDENT)


def test_lease_tokens_stay_in_a_release_word_and_off_its_reserved_values() -> None:
    """A lease token is never 0 (a fresh word) nor 2**64 - 1 (the daemon's "no lease"), and
    fits the word's 64 bits at any epoch a Loader starts (past 2**64 it raised OverflowError
    when the daemon armed it)."""
    assert lease_token(0, 0, 10) == 1
    assert lease_token(3, 4, 10) == 35
    for epoch, index, n in [
        (MAX_EPOCH, 0, 2**40),
        (MAX_EPOCH + 1, 5, 2**40),
        (2**63, 7, 9),
        (0, 2**64 - 3, 2**64),
        (0, 2**64 - 2, 2**64),
    ]:
        token = lease_token(epoch, index, n)
        assert 1 <= token <= 2**64 - 2
        np.array([token], dtype=np.uint64)  # what the daemon stores
    assert lease_token(0, 2**64 - 2, 2**64) == 1  # wraps past 2**64 - 2 leases


# -- mismatches ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "argument"),
    [
        ("seed", 8, "the seed differs"),
        ("order", "SEQUENTIAL", "the order differs"),
        ("batch_size", 2, "the batch_size differs"),
        ("drop_last", False, "the drop_last differs"),
        ("distributed", True, "the distributed differs"),
        ("rank", 1, "the rank"),
        ("world_size", 2, "the world_size"),
        ("num_samples", 21, "indices .or the dataset"),
        ("indices", indices_digest([1, 2]), "the indices"),
        ("len", 4, "batches per epoch"),
    ],
)
def test_each_mismatch_is_a_spec_error_naming_the_argument(key, value, argument) -> None:
    with _loader() as ld:
        s = ld.state_dict()
        with pytest.raises(SpecError, match=f"{key}=.*{argument}"):
            ld.load_state_dict({**s, key: value})
        ld.load_state_dict(s)  # the unchanged state still loads


def test_states_of_loaders_with_other_arguments_are_refused() -> None:
    with _loader() as a:
        s = a.state_dict()
    others = [
        ({"seed": 8}, "seed"),
        ({"order": OrderOption.QUASI_RANDOM}, "order"),
        ({"batch_size": 3}, "batch_size"),
        ({"drop_last": False}, "drop_last"),
        ({"indices": list(range(21, -1, -1))}, "indices"),  # every sample, another order
        ({"indices": list(range(20))}, "num_samples"),
    ]
    for kw, key in others:
        with _loader(**kw) as b, pytest.raises(SpecError, match=f"{key}="):
            b.load_state_dict(s)


# -- the dataset, next_epoch, version-less keys, a closed Loader (an audit's findings) -------
def _file_loader(path, **kw):
    from beton_serve.fields.decoders import IntDecoder

    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 1)
    kw.setdefault("seed", 7)
    kw.setdefault("order", OrderOption.RANDOM)
    return Loader(str(path), pipelines={"vec": None, "label": [IntDecoder()]}, **kw)


def _file_labels(ld) -> list[list[int]]:
    return [np.asarray(b[0]).reshape(-1).tolist() for b in ld]


def test_a_state_of_another_file_of_the_same_size_is_refused(tmp_path) -> None:
    """A state saved on ``a.beton`` loaded into a Loader over ``b.beton`` (same size, schema
    and arguments, other labels) went on with b's samples at a's position. A copy of the same
    file resumes; an older version-2 state without ``dataset`` still loads."""
    import shutil

    from helpers.labelled import write_labelled

    a = write_labelled(tmp_path / "a.beton", 23, base=1000)
    b = write_labelled(tmp_path / "b.beton", 23, base=5000)
    copy = tmp_path / "elsewhere" / "a.beton"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    with _file_loader(a) as ref:
        want = _file_labels(ref)
    with _file_loader(a) as ld:
        it = iter(ld)
        next(it), next(it)
        s = ld.state_dict()
    assert isinstance(s["dataset"], str) and s["dataset"].startswith("v2:")
    assert len(s["dataset"]) == 35
    with _file_loader(b) as other:
        with pytest.raises(SpecError, match=r"dataset=.*saved on another file"):
            other.load_state_dict(s)
        assert other.state_dict()["dataset"] != s["dataset"]
        legacy = {k: v for k, v in s.items() if k != "dataset"}
        other.load_state_dict(legacy)  # cannot tell: loads, as before
    with _file_loader(copy) as same:
        same.load_state_dict(s)
        assert _file_labels(same) == want[2:]


def test_a_state_whose_dataset_digest_is_of_an_older_version_resumes_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Digests before ``v2:`` hashed only the files' ends and cannot be compared with this
    version's: such a state resumes, unchecked on ``dataset``, and says so."""
    import dataclasses
    import logging

    ident = dataclasses.replace(IDENT, dataset="v2:" + "a" * 32)
    state = make_state(epoch=1, batch=2, identity=ident)
    with caplog.at_level(logging.WARNING, logger="beton_wire"):
        assert check_state({**state, "dataset": "f" * 32}, ident) == (1, 2)
    assert "another beton-serve version" in caplog.text
    with pytest.raises(StateError, match="dataset="):
        check_state({**state, "dataset": "v2:" + "b" * 32}, ident)


def test_a_state_of_a_dataset_regenerated_between_its_ends_is_refused(tmp_path) -> None:
    """Raw pixels regenerated with the same sizes, labels and order leave a file's first and
    last 64 KiB as they were; the dataset digest hashed only those, so a state saved on the old
    file resumed on the new one, its pixels read at the old position with no word."""
    from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
    from helpers.labelled import write_pixels

    old = write_pixels(tmp_path / "old" / "train.beton", 256)
    new = write_pixels(tmp_path / "new" / "train.beton", 256, shift=7, changed=range(40, 216))
    pipes = {"pixels": [NDArrayDecoder()], "label": [IntDecoder()]}
    kw = {"batch_size": 16, "num_workers": 1, "seed": 7, "order": OrderOption.RANDOM}
    with Loader(str(old), pipelines=pipes, **kw) as ld:
        it = iter(ld)
        next(it)
        s = ld.state_dict()
    with Loader(str(new), pipelines=pipes, **kw) as other:
        pixels = np.concatenate([np.asarray(p)[:, 0] for p, _ in other])
        labels = np.concatenate([np.asarray(y).reshape(-1) for _, y in other])
        assert (pixels != labels % 251).any()  # the new file's pixels are other pixels
        with pytest.raises(SpecError, match=r"dataset=.*saved on another file"):
            other.load_state_dict(s)


def test_next_epoch_set_after_a_partial_epoch_or_a_loaded_state_is_what_iter_and_state_do(
    caplog,
) -> None:
    """FFCV's way to resume is ``loader.next_epoch = e``. Set mid-epoch, ``state_dict()`` still
    said the old epoch's position (a checkpoint replayed finished epochs); set after
    ``load_state_dict()``, the new epoch started at the loaded state's batch (its first batches
    silently dropped)."""
    with _loader() as ref:
        epochs = [_labels(ref) for _ in range(5)]
    with _loader() as ld:
        it = iter(ld)
        next(it), next(it)
        assert (ld.state_dict()["epoch"], ld.state_dict()["batch"]) == (0, 2)
        ld.next_epoch = 3
        assert (ld.state_dict()["epoch"], ld.state_dict()["batch"]) == (3, 0)
        got = _labels(ld)
    for g, w in zip(got, epochs[3], strict=True):
        np.testing.assert_array_equal(g, w)
    with _loader() as ref, _loader() as ld:
        it = iter(ref)
        next(it), next(it)
        ref.next_epoch = 1  # position (0, 2) stands: next_epoch as iter() left it
        s = ref.state_dict()
        assert (s["epoch"], s["batch"]) == (0, 2)
        ld.load_state_dict({**s, "epoch": 1})
        assert (ld.state_dict()["epoch"], ld.state_dict()["batch"]) == (1, 2)
        ld.next_epoch = 4
        assert (ld.state_dict()["epoch"], ld.state_dict()["batch"]) == (4, 0)
        with caplog.at_level("WARNING", logger="beton_client"):
            got = _labels(ld)
        assert "epoch 4 starts from its first batch" in caplog.text
    assert len(got) == len(epochs[4])
    for g, w in zip(got, epochs[4], strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_version_less_state_is_checked_on_every_key_it_has() -> None:
    """A version-2 state whose ``version`` a checkpoint tool dropped: only seed, len, rank and
    world_size were compared, so another order, batch size or subset loaded silently."""
    with _loader() as ld:
        s = {k: v for k, v in ld.state_dict().items() if k != "version"}
        ld.load_state_dict(s)  # its own loads
        for key, value in [
            ("order", "SEQUENTIAL"),
            ("batch_size", 3),
            ("drop_last", False),
            ("distributed", True),
            ("num_samples", 9),
            ("indices", indices_digest([1, 2])),
        ]:
            with pytest.raises(SpecError, match=f"{key}="):
                ld.load_state_dict({**s, key: value})


def test_state_dict_after_close_is_the_last_position() -> None:
    with _loader() as ld:
        it = iter(ld)
        next(it)
    s = ld.state_dict()  # raised "the Loader is closed" unless called once before
    assert (s["epoch"], s["batch"], s["len"]) == (0, 1, 5)
    with _loader() as fresh:
        fresh.load_state_dict(s)
