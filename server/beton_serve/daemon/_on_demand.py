"""Files opened on demand: a client names a ``.beton`` the daemon does not serve yet.

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

Threads: :func:`open_file` runs on the daemon's ``beton-compile`` thread (it reads and validates
the file); everything else on the event-loop thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from beton_wire.file_identity import FileIdentity
from beton_wire.limits import short_repr

__all__ = ["FilePolicy"]


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

    @classmethod
    def build(cls, *, enabled: bool, data_roots: Sequence[str], idle_close_s: float) -> FilePolicy:
        """A policy with ``data_roots`` resolved to real paths."""
        roots = tuple(os.path.realpath(r) for r in data_roots)
        return cls(enabled=enabled, data_roots=roots, idle_close_s=float(idle_close_s))

    def refusal(self, file: FileIdentity, *, owner_peer: bool) -> str | None:
        """Why ``file`` may not be opened for this peer, or ``None`` when it may."""
        if not self.enabled:
            return "this daemon opens no other file (--no-open-on-demand)"
        if not file.path.endswith(".beton"):
            return "only .beton files are opened on demand"
        if owner_peer:
            return None
        real = os.path.realpath(file.path)
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
