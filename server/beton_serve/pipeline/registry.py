"""Wire names of ops: rebuild an op from ``(spec_name, spec_params)``.

Pipelines travel to the daemon as data: a list of ``{"op": name, "params": {...}}``. Every
built-in op has a ``spec_name`` (its FFCV class name) and JSON-safe ``spec_params()``;
:func:`op_from_spec` turns them back into an op. Plugins add their ops with :func:`register_op`.

Built-ins are registered by module path and imported on first use, so importing this module does
not import Numba, OpenCV or torch. A registry is an object (:class:`OpRegistry`); the module-level
functions use the default one, which holds the built-ins.

Two reserved wire names carry a user's ops (docs/custom-ops.md):

* :data:`IMPORT_OP` (``"@import"``): an op the daemon may build itself, with params
  ``{"spec": {"name", "params"} | None, "import": Operation.import_spec() | None, "why": [str],
  "decoder": bool}``. :meth:`OpRegistry.build_imported` imports the named module from the
  daemon's own ``sys.path`` (never code from the wire); the daemon calls it only for peers its
  :class:`~beton_serve.daemon.OpImportPolicy` trusts.
* :data:`CLIENT_OP` (``"@client"``): a placeholder for an op the client runs itself. It keeps
  the op's node (hence its position, which random ops' seeds derive from) in the daemon's graph,
  and ends the daemon-side (jit) prefix there.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State

__all__ = [
    "CLIENT_OP",
    "IMPORT_OP",
    "ClientOp",
    "OpRegistry",
    "default_registry",
    "op_from_spec",
    "register_op",
    "registered_ops",
]

#: Wire name of an op the daemon may import from its own disk (see the module docstring).
IMPORT_OP = "@import"
#: Wire name of the placeholder of an op that runs in the client.
CLIENT_OP = "@client"


class ClientOp(Operation):
    """Placeholder for an op the client runs: it ends the jit prefix and keeps its node's place.

    Its output state is its input's, out of jit mode, so the planner ends the daemon-side prefix
    before it; nothing calls its function (the client tail is run by the client).
    """

    spec_name = CLIENT_OP

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        return replace(previous_state, jit_mode=False), None

    def generate_code(self) -> Callable[..., Any]:
        def client_side(inp, dst):
            raise SpecError("this op runs in the client; the daemon cannot run it")

        return client_side

    def spec_params(self) -> dict[str, Any]:
        return {}


_DECODERS = "beton_serve.fields.decoders"
_T = "beton_serve.transforms"

#: Built-in ops: wire name -> module that defines the class of that name.
BUILTINS: dict[str, str] = {
    "IntDecoder": _DECODERS,
    "FloatDecoder": _DECODERS,
    "BytesDecoder": _DECODERS,
    "NDArrayDecoder": _DECODERS,
    "SimpleRGBImageDecoder": _DECODERS,
    "RandomResizedCropRGBImageDecoder": _DECODERS,
    "CenterCropRGBImageDecoder": _DECODERS,
    **{
        name: _T
        for name in (
            "RandomHorizontalFlip",
            "RandomTranslate",
            "Cutout",
            "RandomBrightness",
            "RandomContrast",
            "RandomSaturation",
            "RandomResizedCrop",
            "ImageMixup",
            "LabelMixup",
            "MixupToOneHot",
            "Poison",
            "ReplaceLabel",
            "NormalizeImage",
            "ToTensor",
            "ToDevice",
            "ToTorchImage",
            "Convert",
            "View",
            "Squeeze",
            "ModuleWrapper",
        )
    },
}


class OpRegistry:
    """Maps wire names to op classes. Thread-safe."""

    def __init__(self, builtins: dict[str, str] | None = None) -> None:
        self._lazy: dict[str, str] = dict(builtins or {})
        self._classes: dict[str, type[Operation]] = {}
        self._lock = threading.Lock()

    def register(self, cls: type[Operation]) -> type[Operation]:
        """Register ``cls`` under ``cls.spec_name``; usable as a class decorator.

        Raises:
            SpecError: ``cls`` is not an ``Operation`` subclass, has no ``spec_name``, or the
                name is taken by a different class.
        """
        if not (inspect.isclass(cls) and issubclass(cls, Operation)):
            raise SpecError(f"register_op needs an Operation subclass, got {cls!r}")
        name = cls.spec_name
        if not name or not isinstance(name, str):
            raise SpecError(f"{cls.__name__} needs a class attribute spec_name (a str) to register")
        with self._lock:
            current = self._classes.get(name)
            if current is not None and current is not cls:
                raise SpecError(
                    f"op name {name!r} is already registered to {current.__module__}."
                    f"{current.__qualname__}; give {cls.__qualname__} another spec_name"
                )
            self._classes[name] = cls
            self._lazy.pop(name, None)
        return cls

    def names(self) -> list[str]:
        """All registered wire names, sorted."""
        with self._lock:
            return sorted(set(self._classes) | set(self._lazy))

    def lookup(self, name: str) -> type[Operation]:
        """The class registered as ``name`` (importing a built-in's module on first use)."""
        with self._lock:
            cls = self._classes.get(name)
            module = self._lazy.get(name)
        if cls is not None:
            return cls
        if module is None:
            raise SpecError(
                f"unknown op {name!r}; registered ops are {', '.join(self.names())} "
                "(custom ops must be loaded into the daemon as a plugin and registered)"
            )
        found = getattr(importlib.import_module(module), name)
        with self._lock:
            self._classes.setdefault(name, found)
            self._lazy.pop(name, None)
        return found  # type: ignore[no-any-return]

    def build_imported(self, spec: Any) -> Operation:
        """Build a user's op from its ``Operation.import_spec()``, importing its module here.

        The module is imported by name from this process's ``sys.path`` (the daemon's own disk);
        nothing but the names and the JSON arguments comes from the request. The caller decides
        whether the peer may make it import at all (``OpImportPolicy``).

        Raises:
            SpecError: the spec is malformed, the module cannot be imported, the name is not an
                ``Operation`` subclass there, or its constructor rejected the arguments.
        """
        if not isinstance(spec, dict):
            raise SpecError("no import path was sent for this op")
        module, qualname = spec.get("module"), spec.get("qualname")
        args, kwargs = spec.get("args", []), spec.get("kwargs", {})
        if not (isinstance(module, str) and module and isinstance(qualname, str) and qualname):
            raise SpecError("the op's import path needs a module and a qualname")
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise SpecError("the op's recorded arguments must be a list and an object")
        if module == "__main__" or module.startswith(".") or "<locals>" in qualname:
            raise SpecError(f"{module}.{qualname} cannot be imported by name")
        try:
            obj: Any = importlib.import_module(module)
        except Exception as exc:  # an ImportError, or whatever the module's top level raised
            raise SpecError(
                f"the daemon cannot import module {module!r} ({type(exc).__name__}: {exc}); "
                "install it where the daemon runs, or put it on the daemon's PYTHONPATH"
            ) from None
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise SpecError(f"module {module!r} (the daemon's copy) has no {qualname!r}")
        if not (inspect.isclass(obj) and issubclass(obj, Operation)):
            raise SpecError(f"{module}.{qualname} is not an Operation subclass")
        try:
            return obj(*args, **kwargs)  # type: ignore[no-any-return]
        except SpecError:
            raise
        except Exception as exc:
            raise SpecError(
                f"{module}.{qualname}(*{args!r}, **{kwargs!r}) failed in the daemon: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def build(self, name: str, params: dict[str, Any] | None) -> Operation:
        """Build the op ``name`` from its ``spec_params``.

        A class may define ``from_spec(params)`` (a classmethod) when its constructor does not
        take ``spec_params()`` as keyword arguments; otherwise ``cls(**params)`` is called.

        Raises:
            SpecError: unknown name, params not a dict of str keys, or the constructor rejected
                them (the message names the op and its expected parameters).
        """
        if name == CLIENT_OP:  # reserved names: built by every registry, never listed
            return ClientOp()
        if name == IMPORT_OP:
            # The daemon rewrites these params itself after asking its OpImportPolicy; a client
            # cannot set "import_allowed" (docs/custom-ops.md).
            if not isinstance(params, dict) or params.get("import_allowed") is not True:
                raise SpecError("importing op modules is not allowed for this request")
            return self.build_imported(params.get("import"))
        cls = self.lookup(name)
        if params is None:
            params = {}
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise SpecError(f"params of op {name!r} must be a JSON object, got {params!r}")
        factory = getattr(cls, "from_spec", None)
        try:
            if factory is not None:
                return factory(dict(params))  # type: ignore[no-any-return]
            return cls(**params)
        except SpecError:
            raise
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            try:
                sig = (
                    str(inspect.signature(cls.__init__))
                    .replace("(self, ", "(")
                    .replace("(self)", "()")
                )
            except (TypeError, ValueError):
                sig = "(...)"
            raise SpecError(
                f"bad params for op {name!r}: {exc}; expected {name}{sig}, got {params!r}"
            ) from None


_DEFAULT = OpRegistry(BUILTINS)


def default_registry() -> OpRegistry:
    """The registry holding the built-ins and every op registered with :func:`register_op`."""
    return _DEFAULT


def register_op(cls: type[Operation]) -> type[Operation]:
    """Register ``cls`` (under ``cls.spec_name``) in the default registry; a class decorator."""
    return _DEFAULT.register(cls)


def op_from_spec(name: str, params: dict[str, Any] | None = None) -> Operation:
    """Build a registered op from its wire name and ``spec_params()``; raises ``SpecError``."""
    return _DEFAULT.build(name, params)


def registered_ops() -> list[str]:
    """Sorted wire names of the default registry."""
    return _DEFAULT.names()
