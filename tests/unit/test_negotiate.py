"""Transport negotiation, on CPU, with fake host identities, devices and IPC probes."""

from __future__ import annotations

import dataclasses

import pytest
from beton_serve.errors import SpecError, TransportError
from beton_serve.transport.negotiate import (
    REASON_TEXT,
    ClientOffer,
    CudaDevice,
    DaemonFacts,
    HostIdentity,
    Reason,
    negotiate,
    normalize_uuid,
)

UUID_A = "GPU-1e5b1bc3-7f0a-4c55-9d8e-0123456789ab"
UUID_B = "GPU-ffffffff-0000-1111-2222-333333333333"
HOST = HostIdentity(boot_id="boot-1", hostname="node1", uid=1000, pid=10, ipc_ns=4026531839)


def _client(**kw) -> ClientOffer:
    base = dict(
        identity=dataclasses.replace(HOST, pid=20),
        device="cuda:0",
        has_torch=True,
        has_cuda=True,
        has_cupy=True,
        cuda_devices=(CudaDevice(index=0, uuid=UUID_A),),
    )
    base.update(kw)
    return ClientOffer(**base)


class Probe:
    """A fake CUDA IPC probe that records the device indices it was asked about."""

    def __init__(self, ok: bool = True, why: str = "") -> None:
        self.ok, self.why, self.calls = ok, why, []

    def __call__(self, index: int) -> tuple[bool, str]:
        self.calls.append(index)
        return self.ok, self.why


def _daemon(probe: Probe | None = None, **kw) -> DaemonFacts:
    base = dict(
        identity=HOST,
        has_cupy=True,
        # The daemon sees two GPUs; the client's GPU A is the daemon's index 1.
        cuda_devices=(CudaDevice(index=0, uuid=UUID_B), CudaDevice(index=1, uuid=UUID_A)),
        ipc_probe=probe or Probe(),
    )
    base.update(kw)
    return DaemonFacts(**base)


def test_same_host_gpu_client_gets_cuda_ipc_on_the_daemons_index():
    probe = Probe()
    result = negotiate(_client(), _daemon(probe))
    assert result.transport == "cuda_ipc"
    assert result.device_index == 1  # matched by UUID, not by index
    assert result.rejected == ()
    assert probe.calls == [1]


def test_cpu_client_gets_shm_without_probing_and_without_rejections():
    probe = Probe()
    result = negotiate(_client(device="cpu"), _daemon(probe))
    assert (result.transport, result.rejected, probe.calls) == ("shm", (), [])


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (dict(boot_id="boot-2"), Reason.DIFFERENT_HOST),
        (dict(hostname="node2"), Reason.DIFFERENT_HOST),
        (dict(boot_id=""), Reason.DIFFERENT_HOST),  # unknown identity is never "same host"
    ],
)
def test_different_host_falls_back_to_grpc_with_reasons_for_both(change, code):
    client = _client(identity=dataclasses.replace(HOST, **change))
    result = negotiate(client, _daemon())
    assert result.transport == "grpc"
    assert [(r.transport, r.code) for r in result.rejected] == [("cuda_ipc", code), ("shm", code)]


def test_container_without_shared_ipc_namespace_gets_grpc():
    client = _client(identity=dataclasses.replace(HOST, ipc_ns=4026532000))
    result = negotiate(client, _daemon())
    assert result.transport == "grpc"
    codes = {r.transport: r.code for r in result.rejected}
    assert codes == {
        "cuda_ipc": Reason.DIFFERENT_IPC_NAMESPACE,
        "shm": Reason.DIFFERENT_IPC_NAMESPACE,
    }
    assert "4026532000" in result.rejected[1].message
    assert "--ipc=host" in result.rejected[1].hint


def test_unknown_ipc_namespace_is_not_held_against_the_client():
    client = _client(identity=dataclasses.replace(HOST, ipc_ns=None))
    assert negotiate(client, _daemon()).transport == "cuda_ipc"


def test_other_user_gets_grpc():
    client = _client(identity=dataclasses.replace(HOST, uid=1001))
    result = negotiate(client, _daemon())
    assert result.transport == "grpc"
    assert {r.code for r in result.rejected} == {Reason.DIFFERENT_USER}


def test_sandbox_that_refuses_ipc_falls_back_to_shm_with_the_probe_error():
    probe = Probe(ok=False, why="cudaErrorNotSupported: operation not supported")
    result = negotiate(_client(), _daemon(probe))
    assert result.transport == "shm"
    (rej,) = result.rejected
    assert rej.code is Reason.IPC_REFUSED
    assert "cudaErrorNotSupported" in rej.message
    assert "cuda_ipc rejected [ipc_refused]" in result.summary()


def test_gpu_not_visible_to_daemon_falls_back_to_shm_without_probing():
    probe = Probe()
    daemon = _daemon(probe, cuda_devices=(CudaDevice(index=0, uuid=UUID_B),))
    result = negotiate(_client(), daemon)
    assert result.transport == "shm"
    assert [r.code for r in result.rejected] == [Reason.DEVICE_NOT_VISIBLE]
    assert normalize_uuid(UUID_A) in result.rejected[0].message
    assert probe.calls == []


def test_client_that_did_not_report_its_uuid_is_device_not_visible():
    result = negotiate(_client(cuda_devices=()), _daemon())
    assert [r.code for r in result.rejected] == [Reason.DEVICE_NOT_VISIBLE]


def test_client_index_is_looked_up_in_its_own_numbering():
    client = _client(
        device="cuda:1",
        cuda_devices=(CudaDevice(index=0, uuid=UUID_B), CudaDevice(index=1, uuid=UUID_A)),
    )
    assert negotiate(client, _daemon()).device_index == 1
    client0 = dataclasses.replace(client, device="cuda")  # bare "cuda" means index 0
    assert negotiate(client0, _daemon()).device_index == 0


@pytest.mark.parametrize(
    ("client_kw", "daemon_kw", "code"),
    [
        (dict(has_cupy=False), {}, Reason.CLIENT_NO_CUPY),
        ({}, dict(has_cupy=False), Reason.DAEMON_NO_CUPY),
        (dict(has_cuda=False), {}, Reason.CLIENT_NO_CUDA),
        (dict(has_torch=False), {}, Reason.CLIENT_NO_CUDA),
        ({}, dict(cuda_devices=()), Reason.DAEMON_NO_CUDA),
    ],
)
def test_missing_capability_falls_back_to_shm(client_kw, daemon_kw, code):
    result = negotiate(_client(**client_kw), _daemon(**daemon_kw))
    assert result.transport == "shm"
    assert [(r.transport, r.code) for r in result.rejected] == [("cuda_ipc", code)]
    assert result.rejected[0].hint == REASON_TEXT[code][1]


def test_shm_disabled_on_daemon_still_allows_cuda_ipc_and_else_grpc():
    assert negotiate(_client(), _daemon(shm_enabled=False)).transport == "cuda_ipc"
    result = negotiate(_client(device="cpu"), _daemon(shm_enabled=False))
    assert result.transport == "grpc"
    assert [r.code for r in result.rejected] == [Reason.SHM_DISABLED]


def test_forced_transport_that_works_is_used():
    assert negotiate(_client(transport="shm"), _daemon()).transport == "shm"
    assert negotiate(_client(transport="grpc"), _daemon()).transport == "grpc"
    forced = negotiate(_client(transport="cuda_ipc"), _daemon())
    assert (forced.transport, forced.device_index) == ("cuda_ipc", 1)


@pytest.mark.parametrize(
    ("client_kw", "daemon_kw", "transport", "code"),
    [
        (dict(device="cpu"), {}, "cuda_ipc", Reason.CPU_DEVICE),
        (dict(has_cupy=False), {}, "cuda_ipc", Reason.CLIENT_NO_CUPY),
        ({}, dict(ipc_probe=Probe(ok=False, why="denied")), "cuda_ipc", Reason.IPC_REFUSED),
        (
            dict(identity=dataclasses.replace(HOST, hostname="x")),
            {},
            "shm",
            Reason.DIFFERENT_HOST,
        ),
    ],
)
def test_forced_transport_that_cannot_work_raises_with_the_reason(
    client_kw, daemon_kw, transport, code
):
    with pytest.raises(TransportError, match=rf"\[{code.value}\]") as info:
        negotiate(_client(transport=transport, **client_kw), _daemon(**daemon_kw))
    assert "To fix:" in str(info.value)


def test_every_reason_has_text_and_hint():
    assert set(REASON_TEXT) == set(Reason)
    assert all(msg and hint for msg, hint in REASON_TEXT.values())


def test_offer_round_trips_through_a_plain_dict():
    data = {
        "identity": {
            "boot_id": "boot-1",
            "hostname": "node1",
            "uid": 1000,
            "pid": 5,
            "ipc_ns": 4026531839,
            "unknown_key": 1,
        },
        "device": "cuda:0",
        "transport": "auto",
        "has_torch": True,
        "has_cuda": True,
        "has_cupy": True,
        "cuda_devices": [{"index": 0, "uuid": bytes.fromhex(normalize_uuid(UUID_A))}],
    }
    offer = ClientOffer.from_dict(data)
    assert offer.device_uuid == normalize_uuid(UUID_A)
    assert negotiate(offer, _daemon()).transport == "cuda_ipc"


@pytest.mark.parametrize(
    "bad",
    [
        {"transport": "carrier-pigeon"},
        {"device": "tpu:0"},
        {"cuda_devices": [{"index": 0}]},
        {"cuda_devices": [{"index": 0, "uuid": "not-a-uuid"}]},
        {"identity": {"uid": -1}},
    ],
)
def test_malformed_offer_is_a_spec_error(bad):
    with pytest.raises(SpecError):
        ClientOffer.from_dict(bad)


def test_normalize_uuid_accepts_every_spelling():
    raw = bytes(range(16))
    dashed = "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert normalize_uuid(raw) == normalize_uuid(dashed) == normalize_uuid("GPU-" + dashed.upper())
    with pytest.raises(SpecError):
        normalize_uuid(b"short")
