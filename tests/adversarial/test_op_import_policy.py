"""A client that may not make the daemon import op modules cannot smuggle an import past the
policy (issue 13 §2, route b): not by naming the reserved ``@import`` op as a "plugin", not by
setting ``import_allowed`` itself. The op is handed back to the client instead."""

from __future__ import annotations

import sys
import textwrap

import pytest
from beton_serve.daemon._messages import OpRequest
from beton_serve.daemon._on_demand import resolve_ops
from beton_serve.errors import SpecError
from beton_serve.pipeline.registry import CLIENT_OP, IMPORT_OP, op_from_spec

MODULE = "beton_test_import_sentinel"


@pytest.fixture
def sentinel(tmp_path, monkeypatch):
    """A module on the daemon's path whose import is visible (it is then in sys.modules)."""
    (tmp_path / f"{MODULE}.py").write_text(
        textwrap.dedent(
            """
            from beton_serve.pipeline.operation import Operation

            class Sneaky(Operation):
                def __init__(self, k=1):
                    self.k = k

                def declare_state_and_memory(self, previous_state):
                    return previous_state, None

                def generate_code(self):
                    def same(inp, dst):
                        return inp

                    return same
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(MODULE, None)
    yield
    sys.modules.pop(MODULE, None)


def _imp() -> dict:
    return {"module": MODULE, "qualname": "Sneaky", "args": [], "kwargs": {}}


def _user_op(spec) -> OpRequest:
    return OpRequest(
        name=IMPORT_OP,
        params={"spec": spec, "import": _imp(), "why": [], "decoder": False},
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "spec",
    [
        {"name": IMPORT_OP, "params": {"import_allowed": True, "import": _imp()}},
        {"name": CLIENT_OP, "params": {}},
        None,
    ],
    ids=["reserved-import-as-plugin", "reserved-client-as-plugin", "no-plugin"],
)
def test_a_refused_peer_gets_its_op_handed_back_and_nothing_imported(sentinel, spec) -> None:
    ops = (OpRequest(name="IntDecoder", params={}), _user_op(spec))
    built, local = resolve_ops(ops, build=op_from_spec, import_refusal="uid 4242 is not mine")
    assert MODULE not in sys.modules  # the daemon never imported it
    assert local is not None and local[1]["from"] == 1  # the client runs it (route c)
    assert type(built[1]).__name__ == "ClientOp"


@pytest.mark.timeout(30)
def test_import_allowed_sent_by_a_client_at_top_level_is_refused(sentinel) -> None:
    with pytest.raises(SpecError):
        op_from_spec(IMPORT_OP, {"import": _imp()})  # no import_allowed: refused
    assert MODULE not in sys.modules
    # resolve_ops never passes a client's IMPORT_OP params to the registry as they are.
    ops = (
        OpRequest(name="IntDecoder", params={}),
        OpRequest(
            name=IMPORT_OP,
            params={"import_allowed": True, "import": None, "spec": None, "why": []},
        ),
    )
    _, local = resolve_ops(ops, build=op_from_spec, import_refusal="not mine")
    assert local is not None and MODULE not in sys.modules


@pytest.mark.timeout(30)
def test_a_trusted_peer_does_import_it(sentinel) -> None:
    built, local = resolve_ops(
        (OpRequest(name="IntDecoder", params={}), _user_op(None)),
        build=op_from_spec,
        import_refusal=None,
    )
    assert local is None and type(built[1]).__name__ == "Sneaky" and MODULE in sys.modules


# -- custom_fields classes follow the same policy -------------------------------------------------
FIELD_MODULE = "beton_test_field_sentinel"


@pytest.fixture
def field_module(tmp_path, monkeypatch):
    (tmp_path / f"{FIELD_MODULE}.py").write_text(
        "from beton_serve.fields import IntField\n\nclass Tagged(IntField):\n    pass\n\n"
        "class NotAField:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(FIELD_MODULE, None)
    yield
    sys.modules.pop(FIELD_MODULE, None)


def _is_field(cls: type) -> bool:
    from beton_serve.fields.base import Field

    return issubclass(cls, Field)


@pytest.mark.timeout(30)
def test_a_refused_peer_cannot_make_the_daemon_import_a_field_module(field_module) -> None:
    from beton_serve.daemon._on_demand import resolve_field_classes

    with pytest.raises(SpecError, match="would have to import"):
        resolve_field_classes(
            [f"label={FIELD_MODULE}:Tagged"], import_refusal="uid 9 is not mine", is_field=_is_field
        )
    assert FIELD_MODULE not in sys.modules
    # Once the daemon has the module (a --plugin), any peer may use its classes: nothing new runs.
    __import__(FIELD_MODULE)
    got = resolve_field_classes(
        [f"label={FIELD_MODULE}:Tagged"], import_refusal="uid 9 is not mine", is_field=_is_field
    )
    assert got["label"].__name__ == "Tagged"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("label", "expected 'name=module:qualname'"),
        ("label=__main__:Tagged", "cannot be imported"),
        (f"label={FIELD_MODULE}:NotAField", "not a Field class"),
        (f"label={FIELD_MODULE}:Missing", "has no"),
        ("label=beton_no_such_module_xyz:F", "cannot import module"),
    ],
)
def test_bad_custom_field_entries_are_spec_errors(field_module, entry, words) -> None:
    from beton_serve.daemon._on_demand import resolve_field_classes

    with pytest.raises(SpecError, match=words):
        resolve_field_classes([entry], import_refusal=None, is_field=_is_field)


@pytest.mark.timeout(30)
def test_a_class_from_the_training_script_is_refused_before_sending() -> None:
    from beton_client import Loader
    from beton_client import SpecError as ClientSpecError
    from beton_serve.fields import IntField

    local = type("Local", (IntField,), {"__module__": "__main__"})
    with pytest.raises(ClientSpecError, match="training script"):
        Loader(
            "x.beton", batch_size=4, custom_fields={"label": local}, server="unix:///nope.sock",
            spawn=False,
        )  # fmt: skip
    with pytest.raises(ClientSpecError, match="Field class"):
        Loader(
            "x.beton", batch_size=4, custom_fields={"label": IntField()}, server="unix:///no.sock",
            spawn=False,
        )  # fmt: skip
