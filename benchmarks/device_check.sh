#!/usr/bin/env bash
# GPU validation of kernels/ (issue #3), prepared to run as ONE call of the session's device
# tool, which lends a GPU machine to some sessions only (15 minutes of device time in all):
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=540)
#
# It installs nothing: the device image has torch and triton, and everything here imports only
# those. The kernel tests run with --noconftest because tests/conftest.py loads the model and
# gateway fixtures (fastapi, pydantic, gguf and the model wheel, which the image lacks and which
# would exceed the 64 MiB a call may carry); no kernel test uses them. Each stage has its own
# time limit so a hang in one still returns the others' results, and every result lands in
# $OUT (env.txt, kernel_tests.log, kernels.json, kernels.log, kernels_fp16.json).
#
# On a machine without CUDA it runs the same stages on CPU (Triton in its interpreter), which is
# how it is checked here: OUT=/tmp/device_check bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/device_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
# Nothing is installed there, so the prefixgate.* namespace is made by links: a folder holding
# prefixgate/<folder> -> <folder>/ for the four packages (an implicit namespace package), then the
# repository root last, for tests.* and benchmarks.*.
NS=$(mktemp -d)
trap 'rm -rf "$NS"' EXIT  # only links: nothing of it is worth keeping
mkdir -p "$NS/prefixgate"
for pkg in gateway cache kernels agents; do ln -s "$PWD/$pkg" "$NS/prefixgate/$pkg"; done
export PYTHONUNBUFFERED=1 PYTHONPATH=$NS${PYTHONPATH:+:$PYTHONPATH}:$PWD
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1  # no GPU: the Triton kernels run only in the interpreter
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$PY" - <<'EOF'
import torch, triton
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)")
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
timeout 300 "$PY" -m pytest --noconftest -p no:cacheprovider -q -rs tests/kernels 2>&1 |
    tee "$OUT/kernel_tests.log" || status=1
# the issue's workload (CUDA: batch 64 x 4,096 context, 8 KV / 32 Q heads, D 128, bf16)
timeout 150 "$PY" -m benchmarks.kernels --json "$OUT/kernels.json" 2>&1 |
    tee "$OUT/kernels.log" || status=1
# the same in fp16 (the other GPU cache dtype)
timeout 90 "$PY" -m benchmarks.kernels --dtype fp16 --json "$OUT/kernels_fp16.json" 2>&1 |
    tee -a "$OUT/kernels.log" || status=1
echo "device_check: exit $status (results in $OUT)"
exit $status
