#!/usr/bin/env bash
# GPU verification of the cuda_ipc transport (issue 5 §3), in one run of under 5 minutes.
#
# Runs on the GPU machine (torch with CUDA, CuPy, numba; no PyPI): installs nothing, imports the
# project from the source tree (PYTHONPATH=proto:server:client), then
#   1. prints the environment (GPU, driver, torch, CuPy);
#   2. runs the CUDA IPC probe the daemon uses for negotiation (ok, or the reason it is refused);
#   3. runs `pytest -m gpu tests/gpu -x -q`: IPC hand-off between two processes, event sync under
#      load, DLPack into torch, the ImageNet recipe (fp16 channels-last) on an IPC'd slab,
#      negotiation/fallback with real facts, throughput and hand-off latency;
#   4. prints the figures (one JSON object per line).
# Logs and figures go to $OUT (when set, as on the device tool) or to a temporary folder.
#
# Usage (from anywhere): bash tests/gpu/run_on_device.sh   [PYTHON=/path/to/python3]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

OUT_DIR="${OUT:-$(mktemp -d /tmp/beton-gpu-XXXXXX)}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/proto:$PWD/server:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export BETON_GPU_FIGURES="$OUT_DIR/gpu_figures.jsonl"
rm -f "$BETON_GPU_FIGURES"

run() {
  echo "== environment ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
  "$PY" - <<'EOF'
import platform
print("python", platform.python_version())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("device 0:", p.name, "uuid", getattr(p, "uuid", "?"))
except Exception as exc:
    print("torch: not usable:", exc)
try:
    import cupy
    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as exc:
    print("cupy: not usable:", exc)
EOF

  echo "== CUDA IPC probe (what negotiation sees)"
  timeout 90 "$PY" - <<'EOF'
import time
from beton_serve.transport.cuda_ipc import cuda_facts, probe_cuda_ipc
print("daemon facts:", cuda_facts())
t = time.perf_counter()
print("same-process probe:", probe_cuda_ipc(0, cross_process=False))
print("cross-process probe:", probe_cuda_ipc(0), f"({time.perf_counter() - t:.1f} s)")
EOF

  echo "== pytest -m gpu tests/gpu"
  timeout 240 "$PY" -m pytest -m gpu tests/gpu -x -q -rs -s -p no:cacheprovider
  local rc=$?

  echo "== figures"
  if [ -s "$BETON_GPU_FIGURES" ]; then cat "$BETON_GPU_FIGURES"; else echo "(none recorded)"; fi
  echo "== exit status of pytest: $rc"
  return "$rc"
}

run 2>&1 | tee "$OUT_DIR/gpu_run.log"
exit "${PIPESTATUS[0]}"
