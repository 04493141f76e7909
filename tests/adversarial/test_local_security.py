# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 11, item 3: another local user must not be able to squat the socket directory, plant a
socket or a symbolic link, or lie to the daemon about who it is.

The second user is uid 65534 (``nobody``): files are handed to it with ``chown`` (root only: CI
runs as root; elsewhere those tests skip), and a client runs as it by ``setuid`` in a child that
imported everything first (no user is created, nothing on the system changes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader, UntrustedSocketError
from beton_client._spawn import ensure_daemon
from beton_serve.fields.decoders import IntDecoder
from beton_serve.transport.shm import sweep_stale_segments
from helpers.daemon import (  # noqa: F401
    SHM,
    daemon_factory,
    daemons_serving,
    free_port,
    short_tmp,
    wait_for,
)

OTHER = 65534
INT_ONLY = {"int": [IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
_SERVE = "import sys; from beton_serve.cli import main; sys.exit(main())"


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create files owned by another uid (CI runs as root)")


def _expected_ints(fixtures_dir: Path) -> list[int]:
    return np.load(fixtures_dir / "mixed_fields.expected.npz")["int"].reshape(-1).tolist()


def _ints(ld: Loader) -> list[int]:
    return [int(x) for b in ld for x in np.asarray(b[0]).reshape(-1)]


def _squat(path: Path, uid: int = OTHER, mode: int = 0o777) -> Path:
    """A directory as another user would leave it: theirs, and open to everyone."""
    path.mkdir()
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


def _serve(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``beton-serve serve ARGS`` to its end (it must refuse to start)."""
    r = subprocess.run(
        [sys.executable, "-c", _SERVE, "serve", *args, "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    return r.returncode, r.stdout + r.stderr


def _kill_spawned(sock: str) -> None:
    """Stop any daemon a (buggy) spawn started on ``sock``: it is not our child. Its segments
    are then swept as the next daemon's start would sweep them: a SIGKILL leaves them, and the
    resource guard saw them as leaked whenever the orphan was reaped before its check. The
    sweep is retried until they are gone: the killed daemon's threads may still hold its live
    marker's lock for a moment after its main thread shows as a zombie."""
    pids = daemons_serving(sock)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not daemons_serving(sock), 10.0)

    def swept() -> bool:
        sweep_stale_segments()
        left = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
        return not any(n.startswith(f"beton-{pid}-") for pid in pids for n in left)

    if pids:
        wait_for(swept, 10.0)


_PLANTED = """
import importlib, os, sys
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "IMPORTED"), "w").close()
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules[__name__]
sys.modules[__name__] = importlib.import_module(__name__)
"""


@pytest.mark.slow
def test_a_spawned_daemon_imports_nothing_from_the_trainers_working_directory(
    short_tmp: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module planted in the trainer's working directory (a shared, writable one) under the
    name of one the daemon imports would run as the trainer's user in the spawned daemon."""
    data = fixtures_dir / "mixed_fields.beton"
    cwd = short_tmp / "cwd"
    cwd.mkdir()
    for name in ("cv2", "numba", "grpc"):  # each imported by a serving daemon
        (cwd / f"{name}.py").write_text(_PLANTED)
    sock = str(short_tmp / "s" / "p.sock")
    monkeypatch.chdir(cwd)
    try:
        ensure_daemon(sock, str(data), idle_timeout=30.0, wait=60)
        assert daemons_serving(sock)
        assert not (cwd / "IMPORTED").exists()
    finally:
        _kill_spawned(sock)


# -- the socket directory ------------------------------------------------------------------------
@pytest.mark.slow
def test_daemon_refuses_a_socket_directory_of_another_user(
    short_tmp: Path, fixtures_dir: Path
) -> None:
    _need_root()
    beton = str(fixtures_dir / "mixed_fields.beton")
    squat = _squat(short_tmp / "squat")
    rc, out = _serve([beton, "--socket", str(squat / "beton.sock")])
    assert rc == 1, out
    assert "owned by uid 65534" in out and "--socket" in out and "remove it" in out
    assert os.listdir(squat) == []  # no lock, no socket created in it
    # The default directory ($XDG_RUNTIME_DIR/beton-serve here), squatted the same way.
    xdg = short_tmp / "xdg"
    xdg.mkdir(mode=0o700)
    default_dir = _squat(xdg / "beton-serve")
    env = {k: v for k, v in os.environ.items() if k != "BETON_SERVE_ADDRESS"}
    env["XDG_RUNTIME_DIR"] = str(xdg)
    rc, out = _serve([beton], env)
    assert rc == 1, out
    assert f"{default_dir}" in out and "owned by uid 65534" in out
    assert os.listdir(default_dir) == []


@pytest.mark.slow
def test_a_socket_path_naming_a_file_or_a_directory_deletes_nothing(
    short_tmp: Path, fixtures_dir: Path
) -> None:
    """``--socket notes.txt`` or ``--socket data.beton`` (a typo): the daemon unlinked whatever
    was there, the dataset it was about to serve included. Only a dead daemon's socket is
    replaced; anything else is an error, and stays."""
    d = short_tmp / "own"
    d.mkdir(mode=0o700)
    beton = d / "copy.beton"
    beton.write_bytes((fixtures_dir / "mixed_fields.beton").read_bytes())
    notes = d / "notes.txt"
    notes.write_text("precious")
    (d / "sub").mkdir()
    (d / "link").symlink_to(notes)
    for target in (notes, beton, d / "sub", d / "link"):
        rc, out = _serve([str(beton), "--socket", str(target), "--idle-timeout", "2"])
        assert rc == 1, out
        assert "is there, not a socket" in out and str(target) in out, out
    assert notes.read_text() == "precious" and (d / "link").is_symlink() and (d / "sub").is_dir()
    assert beton.read_bytes() == (fixtures_dir / "mixed_fields.beton").read_bytes()
    assert sorted(os.listdir(d)) == ["copy.beton", "link", "notes.txt", "sub"]  # no lock either
    # A dead daemon's socket (a socket file nobody listens on) is still replaced.
    stale = d / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    rc, out = _serve([str(beton), "--socket", str(stale), "--idle-timeout", "1"])
    assert rc == 0, out
    assert not stale.exists()


@pytest.mark.slow
def test_daemon_refuses_a_socket_directory_others_may_write(
    short_tmp: Path, fixtures_dir: Path
) -> None:
    d = short_tmp / "open"
    d.mkdir()
    os.chmod(d, 0o777)  # our own, but anyone could plant a socket or a link in it
    rc, out = _serve([str(fixtures_dir / "mixed_fields.beton"), "--socket", str(d / "b.sock")])
    assert rc == 1, out
    assert "writable by its group or by others (mode 0777)" in out
    assert os.listdir(d) == []


@pytest.mark.slow
def test_client_refuses_a_default_socket_directory_of_another_user(
    short_tmp: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_root()
    xdg = short_tmp / "xdg"
    xdg.mkdir(mode=0o700)
    squat = _squat(xdg / "beton-serve")
    sock = str(squat / "beton.sock")
    monkeypatch.delenv("BETON_SERVE_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    try:
        # spawn=True (the default): refused before anything is created or started there.
        with pytest.raises(UntrustedSocketError, match="owned by uid 65534, not by uid 0"):
            Loader(str(fixtures_dir / "mixed_fields.beton"), batch_size=5, pipelines=INT_ONLY)
        assert os.listdir(squat) == [] and daemons_serving(sock) == []
        # Without spawning, the default address is still checked before connecting.
        with pytest.raises(UntrustedSocketError, match="socket_owner"):
            Loader("mixed_fields", batch_size=5, pipelines=INT_ONLY, spawn=False)
    finally:
        _kill_spawned(sock)


# -- symbolic links where the lock and log files are opened ------------------------------------------
@pytest.mark.slow
def test_daemon_does_not_follow_a_symlinked_lock_file(
    daemon_factory, short_tmp: Path, fixtures_dir: Path
) -> None:
    own = short_tmp / "own"
    own.mkdir(mode=0o700)
    precious = short_tmp / "precious.txt"
    precious.write_bytes(b"keep me\n")
    os.symlink(precious, own / "d.sock.lock")
    d = daemon_factory(
        [fixtures_dir / "mixed_fields.beton"], socket=str(own / "d.sock"), wait=False
    )
    assert d.proc.wait(30) == 1, d.log()
    assert "d.sock.lock is a symbolic link" in d.log()
    assert precious.read_bytes() == b"keep me\n"  # neither truncated nor written
    assert os.path.islink(own / "d.sock.lock") and not os.path.exists(own / "d.sock")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["auto.sock.spawn.lock", "auto.sock.log"])
def test_spawn_does_not_follow_a_symlinked_lock_or_log_file(
    name: str, short_tmp: Path, fixtures_dir: Path
) -> None:
    own = short_tmp / "own"
    own.mkdir(mode=0o700)
    sock = str(own / "auto.sock")
    precious = short_tmp / "precious.txt"
    precious.write_bytes(b"keep me\n")
    os.symlink(precious, own / name)
    try:
        with pytest.raises(UntrustedSocketError, match="is a symbolic link"):
            ensure_daemon(sock, str(fixtures_dir / "mixed_fields.beton"), idle_timeout=5.0)
        assert daemons_serving(sock) == []
    finally:
        _kill_spawned(sock)
    assert precious.read_bytes() == b"keep me\n"


# -- a socket planted by another user ----------------------------------------------------------------
@pytest.mark.slow
def test_client_refuses_a_socket_another_user_owns_unless_told_to_trust_it(
    daemon_factory, short_tmp: Path, fixtures_dir: Path
) -> None:
    _need_root()
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    link = short_tmp / "link.sock"
    os.symlink(d.socket, link)
    with pytest.raises(UntrustedSocketError, match="is a symbolic link"):
        Loader("mixed_fields", batch_size=5, pipelines=INT_ONLY, server=f"unix://{link}")
    # The planted socket: a live daemon that serves real data, but owned by another user.
    os.lchown(d.socket, OTHER, OTHER)
    with pytest.raises(UntrustedSocketError, match="socket owned by uid 65534, not by uid 0"):
        Loader("mixed_fields", batch_size=5, pipelines=INT_ONLY, server=d.address)
    assert d.stats().streams_opened == 0  # nothing ever reached the daemon
    # Trusting that user's daemon explicitly: their socket in their directory.
    os.chown(short_tmp, OTHER, OTHER)
    with Loader(
        "mixed_fields", batch_size=5, pipelines=INT_ONLY, server=d.address, socket_owner=OTHER
    ) as ld:
        assert _ints(ld) == _expected_ints(fixtures_dir)


# -- the stale-segment sweep -------------------------------------------------------------------------
def test_sweep_removes_only_this_users_regular_files_and_sockets(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    mine = tmp_path / "mine.bin"  # a file of ours that links point to
    mine.write_bytes(b"x" * 8)
    ring = tmp_path / f"beton-{pid}-ring-0"
    ring.write_bytes(b"r")
    notice = tmp_path / f"beton-{pid}-notice-0"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(notice))
    link = tmp_path / f"beton-{pid}-ring-1"
    os.symlink(mine, link)
    fifo = tmp_path / f"beton-{pid}-ring-2"
    os.mkfifo(fifo)
    kept = [link, fifo]
    if os.geteuid() == 0:  # another user's file, and another user's link to a file of ours
        theirs = tmp_path / f"beton-{pid}-ring-3"
        theirs.write_bytes(b"t")
        os.chown(theirs, OTHER, OTHER)
        their_link = tmp_path / f"beton-{pid}-ring-4"
        os.symlink(mine, their_link)
        os.lchown(their_link, OTHER, OTHER)
        kept += [theirs, their_link]
    removed = sweep_stale_segments(tmp_path)
    assert sorted(removed) == sorted([ring.name, notice.name])
    assert not ring.exists() and not os.path.lexists(notice)
    assert [p.name for p in kept if not os.path.lexists(p)] == []
    assert mine.read_bytes() == b"x" * 8


# -- TCP without a token -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_loopback_tcp_listener_without_a_token_is_logged(
    daemon_factory, short_tmp: Path, fixtures_dir: Path
) -> None:
    beton = fixtures_dir / "mixed_fields.beton"
    port = free_port()
    d = daemon_factory([beton], args=["--listen", f"127.0.0.1:{port}"])
    assert f"listening on 127.0.0.1:{port} without a token: every local user can connect" in (
        d.log()
    )
    token = short_tmp / "token"
    token.write_text("s3cret-token\n")
    os.chmod(token, 0o600)
    sock = str(short_tmp / "t.sock")
    args = ["--listen", f"127.0.0.1:{free_port()}", "--token-file", str(token)]
    with_token = daemon_factory([beton], socket=sock, args=args)
    assert "without a token" not in with_token.log()


# -- who the peer is comes from the kernel, never from the request ---------------------------------
_LYING_UID = """
import json, os, sys
import grpc
import numpy as np, numpy.random  # noqa: F401  (everything is imported before setuid)
import beton_client._multi_loader, beton_client._security, beton_client._spawn  # noqa: F401
import beton_client._transport.grpc_receiver, beton_client._transport.shm  # noqa: F401
from beton_client import Loader
from beton_client._transport import identity
from beton_serve.fields.decoders import IntDecoder

target, uid, claimed_uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
real = identity.host_identity()
lie = identity.HostIdentity(boot_id=real.boot_id, hostname=real.hostname, uid=claimed_uid,
                            pid=1, ipc_ns=real.ipc_ns)
identity.host_identity = lambda proc="/proc": lie
facts = identity.gather_facts
identity.gather_facts = lambda d, t="auto": facts(d, t, torch_module=None, cupy_available=False)
pipes = {"int": [IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
if uid != os.getuid():
    # Load what a channel imports lazily before the switch (the checkout may be unreadable by
    # the other uid), without connecting to the daemon: grpc would reuse a connection made as
    # root for the next channel, and the kernel would then report root.
    import grpc._channel  # noqa: F401
    grpc.insecure_channel("127.0.0.1:9").close()
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
with Loader("mixed_fields", batch_size=5, pipelines=pipes, server=target, seed=1, spawn=False,
            reconnect=False) as ld:
    ints = [int(x) for b in ld for x in np.asarray(b[0]).reshape(-1)]
    print(json.dumps({"uid": os.getuid(), "transport": ld.chosen_transport,
                      "codes": [r[1] for r in ld.transport_rejections], "ints": ints}))
"""


def _lying_client(target: str, uid: int, claimed_uid: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _LYING_UID, target, str(uid), str(claimed_uid)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_request_lying_about_its_uid_gets_the_transport_of_its_real_uid(
    daemon_factory, fixtures_dir: Path
) -> None:
    _need_root()
    port = free_port()
    daemon_factory([fixtures_dir / "mixed_fields.beton"], args=["--listen", f"127.0.0.1:{port}"])
    target = f"127.0.0.1:{port}"
    expected = _expected_ints(fixtures_dir)
    # uid 65534 claims to be root (the daemon's user): no shm, grpc, and the right data.
    got = _lying_client(target, OTHER, 0)
    assert got["uid"] == OTHER and got["transport"] == "grpc", got
    assert got["codes"] == ["different_user"] and got["ints"] == expected
    # Root claims to be someone else: the kernel says root, so shm.
    got = _lying_client(target, 0, 12345)
    assert got["transport"] == "shm" and got["codes"] == [] and got["ints"] == expected


_LYING_PID = """
import json, os, sys, time
from beton_client import Loader
from beton_client._transport import identity
from beton_serve.fields.decoders import IntDecoder

real = identity.host_identity()
lie = identity.HostIdentity(boot_id=real.boot_id, hostname=real.hostname, uid=real.uid,
                            pid=int(sys.argv[2]), ipc_ns=real.ipc_ns)
identity.host_identity = lambda proc="/proc": lie
facts = identity.gather_facts
identity.gather_facts = lambda d, t="auto": facts(d, t, torch_module=None, cupy_available=False)
pipes = {"int": [IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
ld = Loader("mixed_fields", batch_size=4, pipelines=pipes, server=sys.argv[1], batches_ahead=2,
            spawn=False, reconnect=False)
it = iter(ld)
next(it)
holder = os.fork()
if holder == 0:  # keeps the inherited connections open after the client dies
    time.sleep(120)
    os._exit(0)
print(json.dumps({"holder": holder}), flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_request_lying_about_its_pid_does_not_keep_a_dead_clients_leases(
    daemon_factory, fixtures_dir: Path
) -> None:
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    # The client claims the pid of a process that stays alive: this test's.
    proc = subprocess.Popen(
        [sys.executable, "-c", _LYING_PID, d.address, str(os.getpid())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    holder = 0
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        holder = json.loads(line)["holder"]
        (stream,) = d.stats().streams
        assert stream.client_pid == proc.pid  # the kernel's pid (SO_PEERCRED), not the claim
        assert stream.transport == "shm" and stream.slots_leased >= 1
        assert d.segments()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # Its connections live on in the holder; the daemon watches the real pid, so it
        # reclaims the stream and its ring anyway.
        wait_for(lambda: not d.stats().streams, 5.0)
        wait_for(lambda: not d.segments(), 5.0)
        os.kill(holder, 0)  # the holder was alive all along
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if holder:
            os.kill(holder, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _running(holder):
                time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_peer_credentials_come_from_the_kernels_socket_table(tmp_path: Path) -> None:
    from beton_serve.transport.peer import peer_credentials, tcp_socket_uid

    # A real loopback connection: the client's socket is found, with this process's uid.
    with socket.create_server(("127.0.0.1", 0)) as srv:
        with socket.create_connection(srv.getsockname()) as cli:
            host, port = cli.getsockname()
            assert tcp_socket_uid(host, port) == os.getuid()
            assert peer_credentials(f"ipv4:{host}:{port}").uid == os.getuid()
    # The table's encoding (32-bit words in host order), IPv6 and IPv4-mapped peers, a peer
    # that is not in the table, and a Unix-socket peer.
    (tmp_path / "net").mkdir()
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    row = "   0: {} 0100007F:1E14 {} 00000000:00000000 00:00000000 00000000  {}  0 7 1\n"
    (tmp_path / "net" / "tcp").write_text(
        head + row.format("0100007F:8A9A", "01", 1001) + row.format("0100007F:8A9B", "0A", 1002)
    )
    v6 = "00000000000000000000000001000000:8A9C"
    (tmp_path / "net" / "tcp6").write_text(head + row.format(v6, "01", 1003))
    assert peer_credentials("ipv4:127.0.0.1:35482", tmp_path).uid == 1001
    assert peer_credentials("ipv6:%5B::ffff:127.0.0.1%5D:35482", tmp_path).uid == 1001
    assert peer_credentials("ipv6:%5B::1%5D:35484", tmp_path).uid == 1003
    assert peer_credentials("ipv4:127.0.0.1:35483", tmp_path).uid is None  # not established
    assert peer_credentials("ipv4:10.1.2.3:35482", tmp_path).uid is None  # another host
    unix = peer_credentials("unix:", tmp_path)
    assert (unix.uid, unix.pid) == (os.getuid(), 0)


# -- a Unix socket opened to other users (the docs once suggested it for socket_owner=) ---------
_OTHER_ON_SOCKET = """
import json, os, sys
import grpc
import numpy as np, numpy.random  # noqa: F401  (everything is imported before setuid)
import beton_client._multi_loader, beton_client._security, beton_client._spawn  # noqa: F401
import beton_client._transport.grpc_receiver, beton_client._transport.shm  # noqa: F401
from beton_client import Loader, ServeOptions
from beton_client._transport import identity
from beton_serve.fields.decoders import IntDecoder

target, uid, private = sys.argv[1], int(sys.argv[2]), sys.argv[3]
facts = identity.gather_facts
identity.gather_facts = lambda d, t="auto": facts(d, t, torch_module=None, cupy_available=False)
pipes = {"int": [IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
import grpc._channel  # noqa: F401
grpc.insecure_channel("127.0.0.1:9").close()
os.setgroups([]); os.setgid(uid); os.setuid(uid)
serve = ServeOptions(server=target, spawn=False, reconnect=False, socket_owner=0)
out = {"uid": os.getuid()}
with Loader("mixed_fields", batch_size=5, pipelines=pipes, seed=1, serve=serve) as ld:
    out["ints"] = [int(x) for b in ld for x in np.asarray(b[0]).reshape(-1)]
    out["transport"] = ld.chosen_transport
    out["codes"] = [r[1] for r in ld.transport_rejections]
try:  # a file the daemon's user can read but serves to nobody: never opened for this caller
    with Loader(private, batch_size=5, pipelines=pipes, serve=serve) as ld:
        out["private"] = sum(1 for _ in ld)
except Exception as exc:
    out["private"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_unix_socket_opened_to_other_users_makes_its_callers_unverified(
    daemon_factory, fixtures_dir: Path, short_tmp: Path
) -> None:
    """The daemon took every caller of its Unix socket for its own user (grpc hides the peer's
    credentials there). Once the socket admitted others (a chmod, as the socket_owner docs
    suggested), another user could have the daemon open any file the daemon's user can read.
    Now such callers are unverified: grpc, and only the datasets served to any peer."""
    _need_root()
    sock = str(short_tmp / "d.sock")
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"], socket=sock)
    private = short_tmp / "other.beton"  # the other uid can read it: only the daemon decides
    private.write_bytes((fixtures_dir / "image_pairs.beton").read_bytes())
    os.chmod(private, 0o644)
    os.chmod(short_tmp, 0o711)
    os.chmod(sock, 0o666)
    r = subprocess.run(
        [sys.executable, "-c", _OTHER_ON_SOCKET, f"unix:{sock}", str(OTHER), str(private)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["uid"] == OTHER
    # The dataset served from the start: over grpc, as to any other user, with the right data.
    assert got["transport"] == "grpc" and got["codes"] == ["different_user"], got
    assert got["ints"] == _expected_ints(fixtures_dir)
    # The file it was never asked to serve: refused, not opened (old code: served it).
    assert isinstance(got["private"], str) and "other.beton" in got["private"], got
    assert "opened on demand" not in d.log(), d.log()[-2000:]
    print(got["private"])
    assert "admits other users" in d.log()


def test_the_socket_watch_sees_a_socket_opened_to_others(tmp_path: Path) -> None:
    from beton_serve.transport.peer import UnixSocketWatch, peer_credentials

    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as s:
        old = os.umask(0o177)
        try:
            s.bind(path)
        finally:
            os.umask(old)
        watch = UnixSocketWatch(path)
        assert watch.private()
        assert peer_credentials("unix:", unix_socket=watch).uid == os.getuid()
        os.chmod(path, 0o660)  # the group may connect now
        assert not watch.private()
        who = peer_credentials("unix:", unix_socket=watch)
        assert who.uid is None and who.source != "unix socket"
        os.chmod(path, 0o600)  # a connection made meanwhile may still be open
        assert not watch.private()
        # A removed socket keeps the verdict it had: nothing connects through it any more.
        fresh = UnixSocketWatch(path)
        os.unlink(path)
        assert fresh.private()


_SQUATTER = """
import os, socket, sys
os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
s = socket.create_server(("127.0.0.1", 0))
s.settimeout(8.0)
print(s.getsockname()[1], flush=True)
try:
    conn, _ = s.accept()
    print("CONNECTED", flush=True)
    conn.close()
except socket.timeout:
    print("NOBODY", flush=True)
"""


@pytest.mark.slow
def test_a_loopback_port_another_user_listens_on_gets_no_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Any local user may listen on a free loopback port (while the daemon restarts, say): a
    Loader connected there and sent its token, then read that user's batches. Now a plain
    loopback channel is refused when another uid listens on its port."""
    _need_root()
    from beton_client import ServeOptions

    squatter = subprocess.Popen(
        [sys.executable, "-c", _SQUATTER, str(OTHER)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert squatter.stdout is not None
        port = int(squatter.stdout.readline())
        serve = ServeOptions(
            server=f"127.0.0.1:{port}", spawn=False, reconnect=False, token="secret-token"
        )
        with pytest.raises(UntrustedSocketError, match=f"listened on by uid {OTHER}"):
            Loader("mixed_fields", batch_size=4, pipelines=INT_ONLY, serve=serve)
        # The CLI's health and stats, which may send a token too, refuse it as well.
        from beton_serve.cli import main

        for cmd in ("health", "stats"):
            assert main([cmd, "--server", f"127.0.0.1:{port}", "--timeout", "2"]) != 0
            assert f"listened on by uid {OTHER}" in capsys.readouterr().err
        assert squatter.stdout.readline().strip() == "NOBODY"  # nothing was sent to it
    finally:
        squatter.kill()
        squatter.wait(10)
