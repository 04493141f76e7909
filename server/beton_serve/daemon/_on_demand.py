"""What a client may make the daemon do on demand: open a file it names, import an op's module.

**Files.** A client names a ``.beton`` the daemon does not serve yet.

``Loader('/data/val.beton')`` against a daemon started for ``train.beton`` (by hand, or
auto-spawned by the first Loader) must not fail: FFCV training scripts open train and val, in
either order. The daemon opens the file the client named, when the client may make it do so
(DESIGN.md §8):

* a peer that is the daemon's own user on its Unix socket (known from the kernel:
  ``transport.peer``) may open any ``.beton`` that user can read: it could read the file itself;
* any other peer (a TCP client, another user on a shared daemon) only files whose real path lies
  under one of the configured data roots (``--data-root``; symlinks resolved first, so a link
  cannot escape a root);
* nobody, with ``--no-open-on-demand``.

The file must end in ``.beton``, so that the daemon's errors cannot be used to probe other files.
After opening, the daemon checks that the file it opened *is* the one the client named
(:class:`~beton_wire.file_identity.FileIdentity`): a file replaced in between is an error, never
another file served. Concurrent opens of one file share one open. A dataset opened on demand is
closed after :attr:`FilePolicy.idle_close_s` seconds without a stream (by the daemon's liveness
monitor, :meth:`Daemon.close_idle`), and opened again when named again.

**Op modules** (docs/custom-ops.md). A user's op that is not a plugin arrives as
``registry.IMPORT_OP``: its class's import path and its JSON constructor arguments. The daemon
imports that module from its own ``sys.path`` (code from its own disk, never from the wire) only
for a peer :class:`OpImportPolicy` trusts: the daemon's own user (on its Unix socket, or a TCP
peer whose socket the kernel says that user owns), or anyone with ``allow_op_imports``. Otherwise,
or when the import or the constructor fails, :func:`resolve_ops` hands that op and the rest of its
pipeline to the client (``registry.CLIENT_OP`` placeholders keep their nodes, hence the seeds of
random ops) and says why, so the client can run them itself and log the cost.

Threads: :func:`open_file` and :func:`resolve_ops` run on the daemon's ``beton-compile`` thread
(they read files, import modules); everything else on the event-loop thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from beton_wire.file_identity import FileIdentity
from beton_wire.limits import short_repr

from beton_serve.daemon._messages import OpRequest
from beton_serve.errors import SpecError

log = logging.getLogger(__name__)

__all__ = [
    "CLIENT_OP",
    "IMPORT_OP",
    "LOCAL_MARKER",
    "MAX_OPEN_ON_DEMAND",
    "FilePolicy",
    "OpImportPolicy",
    "real_path",
    "resolve_ops",
]

#: The default :attr:`FilePolicy.max_open`: each open file holds a descriptor and a mapping, and
#: a client naming file after file must not take the daemon to its descriptor limit.
MAX_OPEN_ON_DEMAND = 256

#: The wire names of ``beton_serve.pipeline.registry`` (repeated here: the daemon does not import
#: the pipeline layer; a unit test checks they agree).
IMPORT_OP = "@import"
CLIENT_OP = "@client"
#: The first of an output's ``client_ops`` when the client must run ops of its pipeline itself:
#: ``(LOCAL_MARKER, {"from": index of the first such op in the sent pipeline, "why": [reasons]})``.
LOCAL_MARKER = "@local"


def real_path(path: str) -> str:
    """``os.path.realpath(path)``, as a ``SpecError`` when the path changes while it is resolved
    (a directory swapped for a symlink between its ``lstat`` and ``readlink``: ``EINVAL``)."""
    try:
        return os.path.realpath(path)
    except OSError as exc:
        raise SpecError(
            f"cannot resolve {short_repr(path)} ({exc.strerror or exc}): was it being moved? "
            "open it again once it is in place"
        ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class FilePolicy:
    """Which files a client may make the daemon open (see the module docstring).

    Attributes:
        enabled: open files on demand at all.
        data_roots: directories under which any peer may open files (real paths).
        idle_close_s: seconds without a stream before a file opened on demand is closed.
    """

    enabled: bool = True
    data_roots: tuple[str, ...] = ()
    idle_close_s: float = 300.0
    #: At most this many datasets opened on demand at once: beyond it, the ones idle longest are
    #: closed first, and when every one has a stream, opening another is refused.
    max_open: int = MAX_OPEN_ON_DEMAND

    @classmethod
    def build(cls, *, enabled: bool, data_roots: Sequence[str], idle_close_s: float) -> FilePolicy:
        """A policy with ``data_roots`` resolved to real paths.

        A root that is not a directory now is kept (a mount may come later) and logged: a typo
        there otherwise showed only as every other user's open being refused.
        """
        roots = tuple(os.path.realpath(r) for r in data_roots)
        for given, real in zip(data_roots, roots, strict=True):
            if not os.path.isdir(real):
                what = "is not a directory" if os.path.exists(real) else "does not exist"
                log.warning(
                    "data root %s %s (yet): other users' clients can open nothing under it "
                    "until it is a directory",
                    short_repr(str(given)),
                    what,
                )
        return cls(enabled=enabled, data_roots=roots, idle_close_s=float(idle_close_s))

    def refusal(self, file: FileIdentity, *, owner_peer: bool) -> str | None:
        """Why ``file`` may not be opened for this peer, or ``None`` when it may."""
        if not self.enabled:
            return "this daemon opens no other file (--no-open-on-demand)"
        if not file.path.endswith(".beton"):
            return "only .beton files are opened on demand"
        if owner_peer:
            return None
        return self._outside_roots(real_path(file.path))

    def serve_refusal(self, ds: Any, *, owner_peer: bool) -> str | None:
        """Why dataset ``ds`` may not be served to this peer, or ``None`` when it may.

        A dataset the daemon was started with is served to every peer (``ds.open_to_all``); a
        file opened on demand only to the daemon's own user and to peers for whom every one of
        its files, where it was when opened (``ds.real_paths``, from the mapped descriptors),
        lies under a data root. That the daemon's user opened it does not open it to others.
        """
        if owner_peer or getattr(ds, "open_to_all", True):
            return None
        for real in ds.real_paths:
            why = self._outside_roots(real)
            if why is not None:
                return why
        return None

    def _outside_roots(self, real: str) -> str | None:
        for root in self.data_roots:
            if os.path.commonpath([root, real]) == root:
                return None
        if not self.data_roots:
            return (
                "a client that is not the daemon's user on its Unix socket may open files only "
                "under a --data-root, and this daemon has none"
            )
        return (
            f"{short_repr(real)} is outside this daemon's data roots "
            f"({', '.join(self.data_roots)}); other clients than the daemon's user on its Unix "
            "socket may open only files under them"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OpImportPolicy:
    """Which peers may make the daemon import a user op's module (see the module docstring).

    Attributes:
        allow_any_peer: ``allow_op_imports``: every peer may (for a daemon whose every client is
            trusted to choose which installed modules it imports); default: the daemon's user only.
        uid: the daemon's uid.
    """

    allow_any_peer: bool = False
    uid: int = field(default_factory=os.getuid)

    def refusal(self, *, owner_peer: bool, peer_uid: int | None) -> str | None:
        """Why this peer may not make the daemon import op modules, or ``None`` when it may."""
        if self.allow_any_peer or owner_peer or (peer_uid is not None and peer_uid == self.uid):
            return None
        who = "an unverified peer" if peer_uid is None else f"uid {peer_uid}"
        return (
            f"the daemon imports op modules only for its own user (uid {self.uid}), not for "
            f"{who}, unless it runs with allow_op_imports (--allow-op-imports)"
        )


def resolve_ops(
    ops: Sequence[OpRequest],
    *,
    build: Callable[[str, Mapping[str, Any]], Any],
    import_refusal: str | None,
) -> tuple[list[Any], tuple[str, dict[str, Any]] | None]:
    """Build one pipeline's daemon-side ops, handing what cannot run here to the client.

    A user's op (:data:`IMPORT_OP`) runs here when the daemon has it registered (a plugin: its
    ``spec``), else when ``import_refusal`` is ``None`` and its module imports and builds here.
    Otherwise (or when the client marked it ``local``: a built-in op whose parameters it would
    not send) it and every later op of the pipeline become :data:`CLIENT_OP` placeholders.

    Args:
        ops: the pipeline as sent.
        build: ``Backend.build_op``.
        import_refusal: :meth:`OpImportPolicy.refusal` for this request's peer.

    Returns:
        ``(ops built, None)`` or ``(ops built, (LOCAL_MARKER, {"from": i, "why": [...]}))`` when
        the client must run ``ops[i:]``.

    Raises:
        SpecError: an op is malformed, or a decoder (the first op) can run nowhere: the message
            says why each way failed.
    """
    built: list[Any] = []
    for i, op in enumerate(ops):
        if op.name == CLIENT_OP:
            built.append(build(CLIENT_OP, {}))
            continue
        if op.name != IMPORT_OP:
            built.append(build(op.name, op.params))
            continue
        why = [str(w) for w in op.params.get("why", ()) if isinstance(w, str)][:4]
        # "local": the client keeps the op (a built-in whose parameters it would not send)
        local = op.params.get("local") is True and op.params.get("decoder") is not True
        got = None if local else _build_user_op(op.params, build, import_refusal, why)
        if got is not None:
            built.append(got)
            continue
        if op.params.get("decoder") is True:
            raise SpecError(
                f"op {i} (a decoder) can run nowhere: a decoder reads the file, so it must run in "
                f"the daemon, and {'; '.join(why)}"
            )
        built.extend(build(CLIENT_OP, {}) for _ in ops[i:])
        return built, (LOCAL_MARKER, {"from": i, "why": why})
    return built, None


def _build_user_op(
    params: Mapping[str, Any],
    build: Callable[[str, Mapping[str, Any]], Any],
    import_refusal: str | None,
    why: list[str],
) -> Any:
    """The op built here, or ``None`` (with the reasons appended to ``why``)."""
    spec = params.get("spec")
    if isinstance(spec, dict) and spec.get("name") in (IMPORT_OP, CLIENT_OP):
        # A reserved name is never a plugin: "@import" inside the plugin route would skip the
        # import policy (the client would set import_allowed itself).
        why.append("plugin: reserved op names cannot name a plugin")
    elif isinstance(spec, dict) and isinstance(spec.get("name"), str):
        sparams = spec.get("params", {})
        try:
            return build(spec["name"], sparams if isinstance(sparams, dict) else {})
        except SpecError as exc:
            text = str(exc)
            if text.startswith("unknown op"):
                text = f"the daemon has no op registered as {short_repr(spec['name'])}"
            why.append(f"plugin: {text}")
    else:
        why.append("plugin: the op has no spec_name the daemon could know it by")
    imp = params.get("import")
    if not isinstance(imp, dict):
        return None  # the client said why in "why"
    if import_refusal is not None:
        why.append(f"import: {import_refusal}")
        return None
    try:
        return build(IMPORT_OP, {"import": imp, "import_allowed": True})
    except SpecError as exc:
        why.append(f"import: {exc}")
        return None


def resolve_field_classes(
    entries: Sequence[str], *, import_refusal: str | None, is_field: Callable[[type], bool]
) -> dict[str, type]:
    """FFCV's ``custom_fields`` from a request: ``"name=module:qualname"`` entries -> classes.

    A class whose module the daemon has already imported (a ``--plugin``, or a module an
    earlier request imported) is used for any peer: nothing new runs. Otherwise the module is
    imported from the daemon's own ``sys.path`` (never code from the wire), only when
    ``import_refusal`` is ``None`` (the :class:`OpImportPolicy` trusts the peer). ``is_field``
    (the backend's) tells a ``Field`` subclass.

    Raises:
        SpecError: a malformed entry, an import the policy refuses or that fails, or a name that
            is not a ``Field`` subclass.
    """
    import importlib
    import inspect
    import sys

    out: dict[str, type] = {}
    for entry in entries:
        name, eq, path = entry.partition("=")
        module, colon, qualname = path.partition(":")
        if not (eq and colon and name and module and qualname):
            raise SpecError(
                f"custom field {short_repr(entry)}: expected 'name=module:qualname' (an older "
                "client sends only names; upgrade beton_client)"
            )
        if module == "__main__" or module.startswith(".") or "<locals>" in qualname:
            raise SpecError(f"custom field {name!r}: {module}.{qualname} cannot be imported")
        mod = sys.modules.get(module)
        if mod is None:
            if import_refusal is not None:
                raise SpecError(
                    f"custom field {name!r}: the daemon would have to import {module!r}, and "
                    f"{import_refusal}; or load that module into the daemon with --plugin"
                )
            try:
                mod = importlib.import_module(module)
            except Exception as exc:  # ImportError, or what the module's top level raised
                raise SpecError(
                    f"custom field {name!r}: the daemon cannot import module {module!r} "
                    f"({type(exc).__name__}: {exc}); install it where the daemon runs, put it on "
                    "its PYTHONPATH, or load it with --plugin"
                ) from None
        obj: Any = mod
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise SpecError(f"custom field {name!r}: module {module!r} has no {qualname!r}")
        if not (inspect.isclass(obj) and is_field(obj)):
            raise SpecError(f"custom field {name!r}: {module}.{qualname} is not a Field class")
        out[name] = obj
    return out
