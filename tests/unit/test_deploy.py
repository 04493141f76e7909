"""The deployment files validate against their schemas, offline.

* every Kubernetes manifest under ``deploy/k8s/`` against the Kubernetes OpenAPI schemas that the
  ``kubernetes-validate`` package ships, in strict mode (unknown keys are errors);
* ``docker-compose.yml`` against the Compose Specification schema (vendored in
  ``tests/data/compose-spec/``, Apache-2.0);
* the Dockerfile, the compose file and the manifests agree with each other and with the CLI (the
  health check's subcommand exists, the socket path and UID are the same everywhere);
* the systemd unit has the sections and keys systemd needs.
"""

from __future__ import annotations

import argparse
import configparser
import json
import re
from pathlib import Path

import pytest
from beton_serve.errors import ConfigError

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"

SOCKET_DIR = "/run/beton-serve"
SOCKET = f"unix://{SOCKET_DIR}/beton-serve.sock"
UID = 10001


def _k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


K8S_DOCS = _k8s_documents()


def _pod_specs() -> dict[str, dict]:
    """Pod template spec of every workload, keyed by kind/name."""
    out = {}
    for _, doc in K8S_DOCS:
        if doc["kind"] in ("DaemonSet", "StatefulSet", "Job"):
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc["spec"]["template"]["spec"]
    return out


def test_k8s_has_the_three_workloads() -> None:
    kinds = sorted(doc["kind"] for _, doc in K8S_DOCS)
    assert kinds.count("DaemonSet") == 1
    assert kinds.count("StatefulSet") == 1
    assert kinds.count("Job") == 1
    services = [doc for _, doc in K8S_DOCS if doc["kind"] == "Service"]
    assert len(services) == 1 and services[0]["spec"]["clusterIP"] == "None"  # headless


@pytest.mark.parametrize("name,doc", K8S_DOCS, ids=[n for n, _ in K8S_DOCS])
def test_k8s_manifest_validates_strictly(name: str, doc: dict) -> None:
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_validator_rejects_a_broken_manifest() -> None:
    """The strict validation really checks: a misspelt key and a wrong type both fail."""
    version = kubernetes_validate.latest_version()
    ds = next(doc for _, doc in K8S_DOCS if doc["kind"] == "DaemonSet")
    typo = json.loads(json.dumps(ds))
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, version, strict=True)
    wrong_type = json.loads(json.dumps(ds))
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "thirty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, version, strict=True)


def test_k8s_headless_service_matches_statefulset() -> None:
    svc = next(doc for _, doc in K8S_DOCS if doc["kind"] == "Service")
    sts = next(doc for _, doc in K8S_DOCS if doc["kind"] == "StatefulSet")
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = sts["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in port_names
    args = _parse_serve(_image_entrypoint() + container["args"])
    assert args.listen == ["0.0.0.0:7700"]
    # Off loopback the daemon needs TLS, a token or --insecure: the pool uses a token from a
    # Secret that the daemon's group can read.
    assert not args.insecure
    token_dir = str(Path(args.token_file).parent)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    secret = volumes[mounts[token_dir]]["secret"]
    assert secret["defaultMode"] & 0o040
    assert sts["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == UID
    from beton_serve.transport.security import check_listen_policy

    check_listen_policy(args.listen[0], tls=False, token=True, insecure=False)
    with pytest.raises(ConfigError):  # without the token the daemon would refuse to start
        check_listen_policy(args.listen[0], tls=False, token=False, insecure=False)


def test_training_job_arguments_parse_with_the_example() -> None:
    """The Job's and the compose trainer's arguments are ones examples/ddp_train.py accepts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "examples" / "ddp_train.py")
    assert spec is not None and spec.loader is not None
    ddp_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp_train)
    job = _pod_specs()["Job/beton-train-example"]["containers"][0]
    assert job["command"][-1].endswith("/ddp_train.py")
    args = ddp_train.parse_args(job["args"])
    assert args.nproc == 2 and args.eval_token_file and args.eval_server
    trainer = _compose()["services"]["trainer"]
    assert ddp_train.parse_args(trainer["command"][1:]).nproc == 2


def test_k8s_daemon_and_job_share_socket_and_shm() -> None:
    """The node daemon and the training Job mount the same host paths, as the same user."""
    specs = _pod_specs()
    ds, job = specs["DaemonSet/beton-serve"], specs["Job/beton-train-example"]

    def host_mounts(spec: dict) -> dict[str, str]:
        host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        mounts = {}
        for m in spec["containers"][0]["volumeMounts"]:
            if m["name"] in host:
                mounts[host[m["name"]]] = m["mountPath"]
        return mounts

    ds_mounts, job_mounts = host_mounts(ds), host_mounts(job)
    for host_path in ("/var/run/beton-serve", "/dev/shm"):
        assert host_path in ds_mounts and host_path in job_mounts
        assert ds_mounts[host_path] == job_mounts[host_path]
    assert ds_mounts["/var/run/beton-serve"] == SOCKET_DIR
    assert ds["securityContext"]["runAsUser"] == job["securityContext"]["runAsUser"] == UID
    # shm and CUDA IPC need one IPC namespace (negotiation reason different_ipc_namespace).
    assert ds["hostIPC"] is True and job["hostIPC"] is True
    env = {e["name"]: e.get("value") for e in job["containers"][0]["env"]}
    assert env["BETON_SERVE_ADDRESS"] == SOCKET
    # The Job also uses the remote pool through its headless Service's DNS names.
    args = job["containers"][0]["args"]
    pool = args[args.index("--eval-server") + 1].split(",")
    assert pool == ["beton-pool-0.beton-pool:7700", "beton-pool-1.beton-pool:7700"]


def test_k8s_probes_use_the_health_subcommand() -> None:
    for name, spec in _pod_specs().items():
        if name.startswith("Job/"):
            continue
        container = spec["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"][:2] == ["beton-serve", "health"], name


def _image_entrypoint() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text()
    m = re.search(r"^ENTRYPOINT (\[.*\])$", text, flags=re.M)
    assert m is not None
    return json.loads(m.group(1))


def _parse_serve(argv: list[str]) -> argparse.Namespace:
    """Parse a daemon command line with the real CLI parser (fails on an unknown flag)."""
    from beton_serve.cli import build_parser

    assert argv[0] == "beton-serve" or argv[0].endswith("/beton-serve"), argv
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as exc:  # argparse exits on an unknown flag
        raise AssertionError(f"the CLI rejects {argv}") from exc
    assert args.command == "serve", argv
    return args


def test_every_daemon_command_line_parses() -> None:
    """The Dockerfile, compose, k8s and systemd command lines use flags the daemon has."""
    entry = _image_entrypoint()
    args = _parse_serve(entry)
    assert args.socket == SOCKET.removeprefix("unix://")
    assert args.config == "/etc/beton-serve/beton-serve.toml"
    text = (DEPLOY / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", text, flags=re.M)
    assert cmd is not None
    assert _parse_serve(entry + json.loads(cmd.group(1))).files == ["/data/dataset.beton"]

    daemon = _compose()["services"]["beton-serve"]
    assert "entrypoint" not in daemon
    files = _parse_serve(entry + daemon["command"]).files
    assert files == ["/data/${BETON_DATASET_FILE:-dataset.beton}"]

    for name, spec in _pod_specs().items():
        container = spec["containers"][0]
        if container["image"].startswith("beton-serve:"):
            assert "command" not in container, name
            assert _parse_serve(entry + container["args"]).files, name

    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read_string((DEPLOY / "beton-serve.service").read_text())
    exec_start = parser["Service"]["ExecStart"].replace("$BETON_DATASETS", "/d/a.beton").split()
    args = _parse_serve(exec_start)
    assert args.files == ["/d/a.beton"]


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_validates_against_the_compose_spec() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_schema_rejects_a_broken_file() -> None:
    """The vendored schema is a real check: an unknown service key and a bad ipc type fail."""
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    bad = _compose()
    bad["services"]["trainer"]["shm-size"] = "1g"  # the key is shm_size
    assert list(validator.iter_errors(bad))
    bad = _compose()
    bad["services"]["beton-serve"]["ipc"] = ["host"]
    assert list(validator.iter_errors(bad))


def test_compose_shares_ipc_socket_and_user() -> None:
    services = _compose()["services"]
    daemon, trainer = services["beton-serve"], services["trainer"]
    assert daemon["ipc"] == "shareable"
    assert trainer["ipc"] == "service:beton-serve"
    assert daemon["shm_size"]
    assert trainer["depends_on"]["beton-serve"]["condition"] == "service_healthy"
    sock = [v for v in daemon["volumes"] if v.endswith(":" + SOCKET_DIR)]
    assert sock and sock[0] in trainer["volumes"]
    assert daemon["user"] == trainer["user"] == f"{UID}:{UID}"
    assert daemon["environment"]["BETON_SERVE_ADDRESS"] == SOCKET
    assert trainer["environment"]["BETON_SERVE_ADDRESS"] == SOCKET
    assert daemon["healthcheck"]["test"][1:3] == ["beton-serve", "health"]
    # The trainer runs an example that exists in the repository (the image copies examples/).
    script = trainer["command"][0]
    assert script.startswith("/opt/beton-serve/examples/")
    assert (ROOT / "examples" / Path(script).name).is_file()


def test_dockerfile_is_slim_nonroot_with_health_check() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert froms and all(f.startswith("python:${PYTHON_VERSION}-slim") for f in froms)
    assert re.search(r"^ARG PYTHON_VERSION=3\.11$", text, flags=re.M)
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"--uid \$\{UID\}", text) and f"ARG UID={UID}" in text
    health = re.search(r"^HEALTHCHECK .*\n\s+CMD (\[.*\])$", text, flags=re.M)
    assert health is not None
    health_cmd = json.loads(health.group(1))
    assert health_cmd[:2] == ["beton-serve", "health"]
    from beton_serve.cli import build_parser

    assert build_parser().parse_args(health_cmd[1:]).command == "health"
    assert f"BETON_SERVE_ADDRESS={SOCKET}" in text
    # Everything COPY'd from the build context exists and is not excluded by the ignore file.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M):
        assert (ROOT / src).exists(), src
    for src in ("pyproject.toml", "proto/**", "server/**", "client/**", "examples/**"):
        assert f"!{src}" in ignore


def test_systemd_unit_has_the_required_keys() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / "beton-serve.service").read_text())
    assert set(parser.sections()) == {"Unit", "Service", "Install"}
    service = parser["Service"]
    exec_start = service["ExecStart"].split()
    assert exec_start[0].startswith("/") and exec_start[0].endswith("/beton-serve")
    assert "--socket" in exec_start
    socket = exec_start[exec_start.index("--socket") + 1]
    assert service["Environment"] == f"BETON_SERVE_ADDRESS=unix://{socket}"
    assert socket.startswith("%t/" + service["RuntimeDirectory"] + "/")
    # As a user unit (%t is $XDG_RUNTIME_DIR) it serves the per-user default socket, where the
    # Loader and `status`/`stop` look without any setting; another name made trainers spawn a
    # second daemon.
    from beton_wire.address import default_socket_path

    runtime = str(ROOT)  # any existing directory stands for $XDG_RUNTIME_DIR
    assert socket.replace("%t", runtime) == default_socket_path({"XDG_RUNTIME_DIR": runtime})
    assert service["ExecStartPost"].split()[1] == "health"
    assert service["KillSignal"] == "SIGTERM"
    assert service["UMask"] == "0077"
    assert parser["Install"]["WantedBy"]


def test_example_config_lists_every_key_with_its_default() -> None:
    """deploy/beton-serve.toml loads through the daemon's own loader and equals the defaults."""
    import tomllib

    from beton_serve.cli.config import KEYS, ServeConfig, load_config

    path = DEPLOY / "beton-serve.toml"
    with path.open("rb") as f:
        raw = tomllib.load(f)
    assert set(raw) == set(KEYS), f"missing: {set(KEYS) - set(raw)}; extra: {set(raw) - set(KEYS)}"
    config = load_config(path)
    assert config == ServeConfig()
    for key, default in KEYS.items():
        value = getattr(config, key)
        assert (tuple(value) if isinstance(default, list) else value) == (
            tuple(default) if isinstance(default, list) else default
        ), key
