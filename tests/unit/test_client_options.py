"""ServeOptions: the serving arguments in one value; the flat keywords still work and warn."""

from __future__ import annotations

import warnings

import pytest
from beton_client import Loader, RetryPolicy, ServeOptions, ServerUnavailable, SpecError

NOWHERE = "unix:///nonexistent/beton-serve-test.sock"
NO_RETRY = RetryPolicy(budget_s=0.0)


def _fails_to_connect(**kwargs: object) -> Loader | None:
    """Build a Loader that passes argument checks and then finds no daemon."""
    with pytest.raises(ServerUnavailable):
        return Loader("images_jpg", batch_size=8, **kwargs)  # type: ignore[arg-type]
    return None


def test_serve_options_reach_the_loader_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing deprecated on the new path
        _fails_to_connect(serve=ServeOptions(server=NOWHERE, spawn=False, reconnect=NO_RETRY))


def test_flat_keywords_still_work_and_warn_once_naming_them() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fails_to_connect(server=NOWHERE, spawn=False, reconnect=NO_RETRY)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1
    text = str(deprecations[0].message)
    assert "reconnect=" in text and "server=" in text and "spawn=" in text
    assert "ServeOptions(" in text
    assert deprecations[0].filename == __file__  # points at the caller's line


def test_a_keyword_and_the_same_option_in_serve_is_an_error() -> None:
    with pytest.raises(SpecError, match="both"):
        Loader(
            "images_jpg",
            batch_size=8,
            serve=ServeOptions(server=NOWHERE, spawn=False),
            server="unix:///elsewhere.sock",
        )


def test_a_keyword_adds_to_serve_when_serve_leaves_it_default() -> None:
    with pytest.warns(DeprecationWarning):
        _fails_to_connect(serve=ServeOptions(server=NOWHERE, reconnect=NO_RETRY), spawn=False)


def test_unknown_keywords_and_wrong_serve_types_are_refused() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        Loader("images_jpg", batch_size=8, sever=NOWHERE)  # type: ignore[call-arg]
    with pytest.raises(SpecError, match="ServeOptions"):
        Loader("images_jpg", batch_size=8, serve={"server": NOWHERE})  # type: ignore[arg-type]


def test_in_process_only_arguments_say_where_their_setting_lives() -> None:
    """Moving from the in-process Loader to the served one, an argument the served one does not
    take names the daemon option (or the reason) instead of only "unexpected"; the list is
    exactly the in-process Loader's parameters that the served Loader lacks."""
    import inspect

    from beton_client._options import IN_PROCESS_ONLY
    from beton_serve.loader import Loader as InProcessLoader

    ours = set(inspect.signature(InProcessLoader).parameters)
    served = set(inspect.signature(Loader).parameters) | {"fname"}  # fname_or_dataset there
    assert set(IN_PROCESS_ONLY) == ours - served
    with pytest.raises(TypeError, match=r"\['verify_checksums'\].*--verify-checksums"):
        Loader("images_jpg", batch_size=8, verify_checksums=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError) as info:
        Loader("images_jpg", batch_size=8, bad_sample_budget=2, sever=1)  # type: ignore[call-arg]
    assert str(info.value) == (
        "Loader() got unexpected keyword arguments ['bad_sample_budget', 'sever'] "
        "(bad_sample_budget: the daemon's setting, --bad-sample-budget N)"
    )


def test_options_are_frozen_and_kept_on_the_loader() -> None:
    opts = ServeOptions(server=NOWHERE, spawn=False)
    with pytest.raises(AttributeError):
        opts.server = "x"  # type: ignore[misc]
    assert ServeOptions() == ServeOptions(transport="auto", spawn=True)


@pytest.mark.parametrize("server", ["", "   ", ["unix:///a.sock", ""]])
def test_an_empty_address_is_a_spec_error(server: object) -> None:
    """``server=""`` reached gRPC, which logged "the target uri is not valid" to stderr and
    raised it as a ``ServerError``, as if a daemon had failed."""
    with pytest.raises(SpecError, match="is empty; leave it None for this host's default socket"):
        Loader("images_jpg", batch_size=8, serve=ServeOptions(server=server, spawn=False))  # type: ignore[arg-type]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("server", ["127.0.0.1:1,127.0.0.1:2", ["h:1", "a:1, b:2"]])
def test_a_comma_list_in_one_address_says_to_pass_a_list(server: object) -> None:
    """``server="a:1,b:2"`` reached gRPC's resolver, which failed after the reconnection
    retries as ``ServerUnavailable`` ("Misformatted domain name"), as if no daemon answered."""
    with pytest.raises(SpecError, match=r"give several daemons as a list: server=\['"):
        Loader("images_jpg", batch_size=8, serve=ServeOptions(server=server, spawn=False))  # type: ignore[arg-type]


@pytest.mark.parametrize("server", ["localhost:99999", ["127.0.0.1:1", "127.0.0.1:0"]])
def test_a_port_outside_1_to_65535_is_a_spec_error(server: object) -> None:
    """gRPC took ``localhost:99999`` and retried it until ``connect_timeout``, then raised
    ``ServerUnavailable`` as if no daemon answered."""
    with pytest.raises(SpecError, match=r"port \d+ of .* is not a TCP port \(1 to 65535\)"):
        Loader("images_jpg", batch_size=8, serve=ServeOptions(server=server, spawn=False))  # type: ignore[arg-type]


@pytest.mark.parametrize("server", ["ipv4:127.0.0.1:1,127.0.0.1:2", "unix:///tmp/a,b.sock"])
def test_gRPC_address_lists_and_socket_paths_may_hold_commas(server: str) -> None:
    from beton_client._loader import _server_list

    assert _server_list(server, "auto") == ([server], server)


@pytest.mark.timeout(60)
def test_an_address_that_never_answers_fails_after_connect_timeout() -> None:
    """A port that accepts connections and never speaks gRPC (a stopped daemon, a wrong
    service) took gRPC's own 20 s connection deadline, plus a retry, to fail."""
    import socket
    import time

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        serve = ServeOptions(
            server=f"127.0.0.1:{port}", spawn=False, reconnect=NO_RETRY, connect_timeout=1.0
        )
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="no beton-serve daemon answers"):
            Loader("images_jpg", batch_size=8, serve=serve)
        assert time.monotonic() - start < 12.0  # a functional bound: the default took 21.5 s


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 7200, "5", True, None])
def test_connect_timeout_must_be_positive_seconds(bad: object) -> None:
    with pytest.raises(SpecError, match="connect_timeout must be seconds"):
        Loader(
            "images_jpg",
            batch_size=8,
            serve=ServeOptions(server=NOWHERE, spawn=False, connect_timeout=bad),  # type: ignore[arg-type]
        )
