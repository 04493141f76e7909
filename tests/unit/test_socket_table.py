"""``beton_wire.socket_table``: who owns a TCP socket, from the kernel's table (a fake ``/proc``
here; the real one in tests/adversarial/test_local_security.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from beton_wire.socket_table import (
    is_loopback,
    loopback_strangers,
    split_host_port,
    tcp_listener_uids,
    tcp_socket_uid,
)

_HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
_ROW = "   0: {} 00000000:0000 {} 00000000:00000000 00:00000000 00000000  {}  0 7 1\n"
_V6_LOOP = "00000000000000000000000001000000"
_V6_ANY = "00000000000000000000000000000000"


def _proc(tmp_path: Path, v4: list[tuple[str, str, int]], v6: list[tuple[str, str, int]]) -> Path:
    (tmp_path / "net").mkdir()
    for name, rows in (("tcp", v4), ("tcp6", v6)):
        text = _HEAD + "".join(_ROW.format(a, st, uid) for a, st, uid in rows)
        (tmp_path / "net" / name).write_text(text)
    return tmp_path


def test_listeners_on_the_address_win_over_the_wildcard(tmp_path: Path) -> None:
    proc = _proc(
        tmp_path,
        [
            ("0100007F:1F90", "0A", 1001),  # 127.0.0.1:8080
            ("00000000:1F90", "0A", 1002),  # 0.0.0.0:8080
            ("00000000:1F91", "0A", 1003),  # 0.0.0.0:8081
            ("0100007F:1F92", "01", 1004),  # 127.0.0.1:8082, established only
        ],
        [(f"{_V6_ANY}:1F93", "0A", 1005), (f"{_V6_LOOP}:1F94", "0A", 1006)],
    )
    assert tcp_listener_uids("127.0.0.1", 8080, proc) == {1001}
    assert tcp_listener_uids("127.0.0.1", 8081, proc) == {1003}
    assert tcp_listener_uids("127.0.0.1", 8082, proc) == set()
    assert tcp_listener_uids("127.0.0.1", 8083, proc) == {1005}  # [::] takes IPv4 too
    assert tcp_listener_uids("[::1]", 8084, proc) == {1006}
    assert tcp_listener_uids("localhost", 8084, proc) == {1006}
    assert tcp_listener_uids("localhost", 8080, proc) == {1001}
    assert tcp_socket_uid("127.0.0.1", 8082, proc) == 1004
    # Who else listens on a loopback port: never the expected owner or root.
    assert loopback_strangers("127.0.0.1:8080", 1001, proc) == set()
    assert os.getuid() not in {1001, 1002, 1003}
    assert loopback_strangers("127.0.0.1:8080", 1002, proc) == {1001}
    assert loopback_strangers("localhost:8081", 1001, proc) == {1003}
    assert loopback_strangers("dns:///localhost:8081", 1001, proc) == {1003}
    assert loopback_strangers("10.0.0.1:8081", 1001, proc) == set()  # not loopback
    assert loopback_strangers("unix:/tmp/x.sock", 1001, proc) == set()


def test_no_table_no_listener(tmp_path: Path) -> None:
    assert tcp_listener_uids("127.0.0.1", 8080, tmp_path) == set()
    assert loopback_strangers("127.0.0.1:8080", 1001, tmp_path) == set()


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("127.0.0.1:7070", ("127.0.0.1", 7070)),
        ("[::1]:7070", ("::1", 7070)),
        ("localhost:7070", ("localhost", 7070)),
        ("dns:///localhost:7070", ("localhost", 7070)),
        ("unix:///tmp/s.sock", None),
        ("ipv4:127.0.0.1:7070,127.0.0.2:7070", None),
        ("127.0.0.1", None),
        ("::1", None),
        ("127.0.0.1:0", None),
        ("127.0.0.1:99999", None),
    ],
)
def test_split_host_port(target: str, expected: tuple[str, int] | None) -> None:
    assert split_host_port(target) == expected


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.8.9.10") and is_loopback("::1")
    assert is_loopback("localhost") and is_loopback("[::1]") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")
