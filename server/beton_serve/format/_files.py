"""Opening the files the format reads: ``.beton`` files and their checksum sidecars."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from beton_wire.file_identity import NOT_REGULAR

__all__ = ["NOT_REGULAR", "NotRegularFile", "open_regular"]


class NotRegularFile(OSError):
    """The path is a directory, a FIFO, a socket or a device."""


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file.

    Opening a FIFO waits for a writer, which hung the in-process Loader (and a daemon given one)
    for good, and reading ``/dev/zero`` never ends: what is not a regular file is refused
    before it is opened, and once more on the file opened (a path replaced in between). A
    file object, not a descriptor of our own: a Ctrl-C between ``os.open`` and the ``try``
    meant to close it leaked it, where a dropped file object closes itself.

    Raises:
        NotRegularFile: naming :data:`NOT_REGULAR`.
        OSError: the path cannot be opened (``FileNotFoundError`` included).
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise NotRegularFile(NOT_REGULAR)
    f = open(path, "rb")
    try:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise NotRegularFile(NOT_REGULAR)
    except BaseException:
        f.close()
        raise
    return f
