"""The client's transport facts: identity from procfs, torch/CUDA facts from a fake torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from beton_client._transport.identity import gather_facts, host_identity
from beton_serve.transport.negotiate import ClientOffer, DaemonFacts, HostIdentity, negotiate

UUID = "1e5b1bc3-7f0a-4c55-9d8e-0123456789ab"


def _fake_proc(tmp_path: Path, boot_id: str = "b00t", ipc: int = 4026531839) -> Path:
    (tmp_path / "sys/kernel/random").mkdir(parents=True)
    (tmp_path / "sys/kernel/random/boot_id").write_text(boot_id + "\n")
    (tmp_path / "self/ns").mkdir(parents=True)
    os.symlink(f"ipc:[{ipc}]", tmp_path / "self/ns/ipc")
    return tmp_path


class FakeCuda:
    def __init__(self, uuids, available=True, broken=False):
        self.uuids, self.available, self.broken = uuids, available, broken

    def is_available(self):
        if self.broken:
            raise RuntimeError("CUDA driver initialization failed")
        return self.available

    def device_count(self):
        return len(self.uuids)

    def get_device_properties(self, i):
        return SimpleNamespace(uuid=self.uuids[i])


def test_identity_of_this_process_matches_the_os():
    ident = host_identity()
    assert ident.pid == os.getpid() and ident.uid == os.getuid()
    assert ident.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    expected_ns = int(os.readlink("/proc/self/ns/ipc").split("[")[1].rstrip("]"))
    assert ident.ipc_ns == expected_ns


def test_identity_from_a_fake_procfs(tmp_path):
    ident = host_identity(_fake_proc(tmp_path, boot_id="abc", ipc=42))
    assert (ident.boot_id, ident.ipc_ns) == ("abc", 42)


def test_missing_procfs_gives_empty_identity_not_an_error(tmp_path):
    ident = host_identity(tmp_path / "nothing")
    assert (ident.boot_id, ident.ipc_ns) == ("", None)


def test_gpu_facts_from_fake_torch(tmp_path):
    torch = SimpleNamespace(cuda=FakeCuda([UUID, "GPU-" + "ab" * 16]))
    facts = gather_facts(
        "cuda:1", "auto", proc=_fake_proc(tmp_path), torch_module=torch, cupy_available=True
    )
    assert (facts.has_torch, facts.has_cuda, facts.has_cupy) == (True, True, True)
    assert [(d.index, d.uuid) for d in facts.cuda_devices] == [
        (0, UUID.replace("-", "")),
        (1, "ab" * 16),
    ]


def test_torch_uuid_object_with_bytes_attribute(tmp_path):
    uuid_obj = SimpleNamespace(bytes=bytes(range(16)))
    facts = gather_facts(
        "cuda:0",
        proc=_fake_proc(tmp_path),
        torch_module=SimpleNamespace(cuda=FakeCuda([uuid_obj])),
        cupy_available=False,
    )
    assert facts.cuda_devices[0].uuid == bytes(range(16)).hex()


def test_no_torch_and_broken_cuda_are_reported_not_raised(tmp_path):
    proc = _fake_proc(tmp_path)
    none = gather_facts("cpu", proc=proc, torch_module=None, cupy_available=False)
    assert (none.has_torch, none.has_cuda, none.cuda_devices) == (False, False, ())
    broken = gather_facts(
        "cuda:0",
        proc=proc,
        torch_module=SimpleNamespace(cuda=FakeCuda([UUID], broken=True)),
        cupy_available=False,
    )
    assert (broken.has_torch, broken.has_cuda) == (True, False)
    cpu_torch = gather_facts("cpu", proc=proc)  # the real (CPU) torch of this machine
    assert cpu_torch.has_torch is True


def test_facts_feed_the_daemons_negotiation(tmp_path):
    proc = _fake_proc(tmp_path)
    torch = SimpleNamespace(cuda=FakeCuda([UUID]))
    facts = gather_facts("cuda:0", proc=proc, torch_module=torch, cupy_available=True)
    offer = ClientOffer.from_dict(facts.to_dict())
    assert offer.device_uuid == UUID.replace("-", "")
    ident = facts.identity
    daemon = DaemonFacts(
        identity=HostIdentity(
            boot_id=ident.boot_id,
            hostname=ident.hostname,
            uid=ident.uid,
            pid=1,
            ipc_ns=ident.ipc_ns,
        ),
        has_cupy=True,
        cuda_devices=offer.cuda_devices,
        ipc_probe=lambda index: (True, ""),
    )
    assert negotiate(offer, daemon).transport == "cuda_ipc"
    without_cupy = ClientOffer.from_dict({**facts.to_dict(), "has_cupy": False})
    assert negotiate(without_cupy, daemon).transport == "shm"


def test_importing_the_client_transport_modules_imports_no_torch_or_cupy():
    code = (
        "import sys, beton_client, beton_client._transport.identity, "
        "beton_client._transport.cuda_ipc\n"
        "bad = [m for m in ('torch', 'cupy', 'numba', 'cv2') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
