"""``beton_wire.private_dir``: the advice given with a refused socket directory."""

from __future__ import annotations

import os
from pathlib import Path


def test_the_remedy_fits_whose_directory_it_is(tmp_path: Path) -> None:
    """ "remove it" was the advice for /tmp itself, and for another user's directory in the
    sticky /tmp, which the user told cannot remove (found by the non-root audit)."""
    from beton_wire.private_dir import UnsafePathError, remedy

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    other_uid = os.getuid() + 12345  # the user asking is someone else
    text = remedy(UnsafePathError(str(shared), "is owned by ..."), other_uid)
    assert "shared directory" in text and "1777" in text and "remove" not in text
    own = tmp_path / "own"
    own.mkdir()
    assert "remove it" in remedy(UnsafePathError(str(own), "is a symbolic link"), os.getuid())
    if os.geteuid() == 0:  # a directory of another (non-root) user, as in a sticky /tmp
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        text = remedy(UnsafePathError(str(theirs), "is owned by uid 65534"), os.getuid())
        assert "only uid 65534 or root can remove it" in text
