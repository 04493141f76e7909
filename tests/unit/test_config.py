"""The daemon's TOML config: one table of keys, unknown keys rejected, flags override."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from beton_serve.cli import build_parser
from beton_serve.cli._serve import resolve_socket
from beton_serve.cli.config import KEYS, ServeConfig, load_config, merge_flags
from beton_serve.daemon import expand_dataset_args
from beton_serve.errors import ConfigError, FormatError
from beton_wire.address import default_socket_path, socket_path_of, unix_target

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_full_file(tmp_path: Path) -> None:
    assert load_config(None) == ServeConfig()
    f = tmp_path / "c.toml"
    f.write_text(
        'files = ["a.beton"]\ndatasets = { imagenet = "train-*.beton", two = ["x", "y"] }\n'
        'socket = "/run/b.sock"\nlisten = ["127.0.0.1:0"]\nworkers = 3\nplugins = ["m"]\n'
        'idle_timeout = 5\nlog_format = "json"\nlog_level = "debug"\n'
    )
    c = load_config(f)
    assert c.files == ("a.beton",) and c.datasets == {
        "imagenet": ("train-*.beton",),
        "two": ("x", "y"),
    }
    assert c.workers == 3 and c.idle_timeout == 5.0 and c.listen == ("127.0.0.1:0",)
    assert c.dataset_args() == ["imagenet=train-*.beton", "two=x,y"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("colour = 1\n", ["unknown key", "colour"]),
        ("workers = 'many'\n", ["workers must be a int"]),
        ("workers = -1\n", ["workers must be in 0..1024"]),
        ("workers = 100000\n", ["workers must be in 0..1024", "100000"]),
        ("listen = '127.0.0.1:1'\n", ["listen must be a list"]),
        ("log_format = 'xml'\n", ["log_format"]),
        ("unattached_timeout = 0\n", ["unattached_timeout must be > 0 seconds"]),
        ("unattached_timeout = nan\n", ["unattached_timeout must be > 0 seconds"]),
        ("idle_close = nan\n", ["idle_close must be > 0 seconds"]),
        ("idle_timeout = nan\n", ["idle_timeout must be >= 0 seconds"]),
        ("idle_timeout = inf\n", ["idle_timeout must be a finite number", "0 means never"]),
        ("idle_close = inf\n", ["idle_close must be a finite number of seconds"]),
        ("unattached_timeout = -inf\n", ["unattached_timeout must be a finite number"]),
        ("workers = true\n", ["workers must be a int, not bool"]),  # it ran with 1 worker
        ("metrics_port = true\n", ["metrics_port must be a int, not bool"]),  # it bound port 1
        ("metrics_host = ''\n", ["metrics_host is empty", "every interface"]),
        ("metrics_host = '  '\n", ["metrics_host is empty"]),
        ("[[broken\n", ["not valid TOML"]),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, words: list[str]) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f)
    for w in words:
        assert w in str(info.value)
    assert str(f) in str(info.value)  # which file (range errors did not say)


def test_flags_override_the_file() -> None:
    base = ServeConfig(files=("a.beton",), workers=2, socket="/x.sock")
    c = merge_flags(base, {"files": ("b.beton",), "workers": 4, "socket": None, "listen": ()})
    assert c.files == ("a.beton", "b.beton") and c.workers == 4 and c.socket == "/x.sock"
    with pytest.raises(ConfigError):
        merge_flags(base, {"nope": 1})


def test_unattached_timeout_from_the_file_and_the_flag(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("unattached_timeout = 5\n")
    assert load_config(f).unattached_timeout == 5.0
    assert ServeConfig().unattached_timeout == 30.0
    args = build_parser().parse_args(["serve", "x.beton", "--unattached-timeout", "2.5"])
    assert args.unattached_timeout == 2.5


def test_deploy_toml_lists_every_key_with_its_default() -> None:
    data = tomllib.loads((ROOT / "deploy" / "beton-serve.toml").read_text())
    assert set(data) <= set(KEYS)
    for k, v in data.items():
        default = KEYS[k]
        assert v == (list(default) if isinstance(default, tuple) else default), k


def test_socket_resolution(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert default_socket_path(env) == str(tmp_path / "beton-serve" / "beton.sock")
    assert default_socket_path({}, uid=7) == "/tmp/beton-serve-7/beton.sock"
    assert socket_path_of(unix_target("/a/b.sock")) == "/a/b.sock" and socket_path_of("h:1") is None
    assert resolve_socket(ServeConfig(socket="/s.sock"), env) == "/s.sock"
    # --listen adds TCP and keeps the per-user socket; --no-socket (unix_socket=False) drops it.
    assert resolve_socket(ServeConfig(listen=("127.0.0.1:1",)), env) == default_socket_path(env)
    assert resolve_socket(ServeConfig(listen=("127.0.0.1:1",), unix_socket=False), env) is None
    assert resolve_socket(ServeConfig(), {"BETON_SERVE_ADDRESS": "unix:///q.sock"}) == "/q.sock"
    assert resolve_socket(ServeConfig(), env) == default_socket_path(env)


def test_cli_treats_a_file_as_serve(fixtures_dir: Path) -> None:
    p = build_parser()
    args = p.parse_args(["serve", "x.beton", "--dataset", "a=b*.beton", "--workers", "2"])
    assert args.files == ["x.beton"] and args.dataset == ["a=b*.beton"] and args.workers == 2


def test_dataset_arguments(tmp_path: Path) -> None:
    for n in ("s-0.beton", "s-1.beton", "one.beton"):
        (tmp_path / n).write_bytes(b"")
    t = expand_dataset_args([str(tmp_path / "one.beton")], [f"all={tmp_path}/s-*.beton"])
    assert t == {
        "one": [str(tmp_path / "one.beton")],
        "all": [str(tmp_path / f"s-{i}.beton") for i in (0, 1)],
    }
    with pytest.raises(ConfigError, match="matches no file"):
        expand_dataset_args([], [f"x={tmp_path}/none-*.beton"])
    with pytest.raises(ConfigError, match="two datasets are named"):
        expand_dataset_args([str(tmp_path / "one.beton")], [f"one={tmp_path}/s-0.beton"])
    with pytest.raises(ConfigError, match="NAME=GLOB"):
        expand_dataset_args([], ["nonsense"])

    # A directory or a FIFO was "does not exist"; a FIFO matched by a glob was taken, and the
    # daemon's start then hung in open() for good.
    os.mkfifo(tmp_path / "s-2.beton")
    (tmp_path / "d.beton").mkdir()
    # A missing or unusable file is a FormatError (exit status 65), as a damaged one is.
    with pytest.raises(FormatError, match=r"s-2\.beton: dataset file .* is not a regular file"):
        expand_dataset_args([], [f"all={tmp_path}/s-*.beton"])
    with pytest.raises(FormatError, match=r"s-2\.beton: dataset file is not a regular file"):
        expand_dataset_args([str(tmp_path / "s-2.beton")], [])
    with pytest.raises(FormatError, match=r"d\.beton: dataset file is a directory"):
        expand_dataset_args([str(tmp_path / "d.beton")], [])
    with pytest.raises(FormatError, match=r"none\.beton: dataset file does not exist"):
        expand_dataset_args([str(tmp_path / "none.beton")], [])
    from beton_serve.cli import main

    assert main(["serve", str(tmp_path / "none.beton")]) == 65


@pytest.mark.parametrize("arg", ["=x.beton", "name=", "=", "nonsense"])
def test_a_malformed_dataset_flag_is_refused(arg: str) -> None:
    """``--dataset =FILE`` and ``--dataset NAME=`` were dropped without a word, and the daemon
    started without that dataset."""
    from beton_serve.cli._serve import run

    args = build_parser().parse_args(["serve", "--dataset", arg])
    with pytest.raises(ConfigError, match="expected NAME=GLOB"):
        run(args, environ={})


def test_an_empty_metrics_host_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match="metrics_host is empty"):
        merge_flags(ServeConfig(), {"metrics_host": ""})


def test_metrics_keys_and_flags(tmp_path: Path, fixtures_dir: Path) -> None:
    cfg_file = tmp_path / "m.toml"
    cfg_file.write_text('metrics_port = 9464\nmetrics_host = "0.0.0.0"\n')
    cfg = load_config(cfg_file)
    assert (cfg.metrics_port, cfg.metrics_host) == (9464, "0.0.0.0")
    assert ServeConfig().metrics_port == -1  # off by default
    assert merge_flags(cfg, {"metrics_port": 0}).metrics_port == 0
    with pytest.raises(ConfigError, match="metrics_port"):
        ServeConfig(metrics_port=70000)
    # log_level is checked when the file loads, by its key's name (it failed later, when logging
    # started, as "--log-level").
    bad = tmp_path / "l.toml"
    bad.write_text('log_level = "loud"\n')
    with pytest.raises(ConfigError, match=r"log_level must be one of debug, .*got 'loud'"):
        load_config(bad)
    bad.write_text('log_level = "WARNING"\n')
    assert load_config(bad).log_level == "WARNING"
    args = build_parser().parse_args(
        ["serve", str(fixtures_dir / "images_raw.beton"), "--metrics-host", "::1"]
    )
    assert args.metrics_host == "::1"


def test_a_socket_path_too_long_for_the_kernel_is_named_on_both_sides(
    tmp_path: Path, fixtures_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sun_path`` holds 107 bytes and a NUL. gRPC reported a longer path as "Failed to bind
    to address" (daemon) or a ``ServerError`` "the target uri is not valid" (client), after
    logging to stderr, without saying why."""
    from beton_client import Loader, ServeOptions
    from beton_client import SpecError as ClientSpecError
    from beton_serve.cli import main as cli_main
    from beton_wire.address import MAX_SOCKET_PATH_BYTES, socket_path_problem

    fits = "/" + "s" * (MAX_SOCKET_PATH_BYTES - 1)
    assert socket_path_problem(fits) is None
    assert socket_path_problem(fits + "s") is not None
    d = tmp_path / ("d" * 60)
    d.mkdir(mode=0o700)
    long = str(d / ("s" * 60 + ".sock"))
    want = f"is {len(long)} bytes long, and a Unix socket path holds at most 107"
    assert cli_main([str(fixtures_dir / "images_raw.beton"), "--socket", long]) == 1
    assert want in capsys.readouterr().err
    with pytest.raises(ClientSpecError, match=want):
        Loader("images_raw", batch_size=2, serve=ServeOptions(server=unix_target(long)))
