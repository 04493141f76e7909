"""``beton-serve cache clear`` on a path that is not a usable cache directory.

Found by an audit: ``BETON_SERVE_CACHE_DIR=/some/regular-file beton-serve cache clear`` printed
``removed 0 cached kernel(s) from /some/regular-file/kernels`` and exited 0, while ``cache info``
said ``not used: /some/regular-file is not a directory``. ``clear`` now gives ``info``'s reason
and exits 1; an absent directory (nothing to clear) still exits 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from beton_serve.cli._cache import main as cache_main


@pytest.fixture
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", str(root))
    return root


def test_clear_of_a_regular_file_says_not_used_and_fails(
    cache_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_env.write_bytes(b"not a directory")
    assert cache_main(["info"]) == 0
    said = capsys.readouterr().out
    assert f"not used: {cache_env} is not a directory" in said
    assert cache_main(["clear"]) == 1
    out, err = capsys.readouterr()
    assert "removed" not in out
    assert f"error: not used: {cache_env} is not a directory; nothing removed" in err
    assert cache_env.read_bytes() == b"not a directory"


def test_clear_with_kernels_a_regular_file_fails(
    cache_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_env.mkdir(mode=0o700)
    (cache_env / "kernels").write_bytes(b"")
    assert cache_main(["clear", "--dir", str(cache_env)]) == 1
    assert f"not used: {cache_env / 'kernels'} is not a directory" in capsys.readouterr().err


def test_clear_of_an_absent_or_empty_cache_succeeds(
    cache_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cache_main(["clear"]) == 0  # absent: nothing to clear
    assert "removed 0 cached kernel(s)" in capsys.readouterr().out
    assert not cache_env.exists()
    cache_env.mkdir(mode=0o700)  # the directory, but no kernels/ yet
    assert cache_main(["clear"]) == 0
    assert "removed 0 cached kernel(s)" in capsys.readouterr().out


def test_info_of_a_cache_without_its_kernels_directory_is_ok(
    cache_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "not used: cannot stat .../kernels" for a directory the first compile had not
    filled yet."""
    cache_env.mkdir(mode=0o700)
    assert cache_main(["info"]) == 0
    out = capsys.readouterr().out
    assert "status:   ok" in out and "not used" not in out
    assert not (cache_env / "kernels").exists()  # info creates nothing
