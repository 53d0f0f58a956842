#!/bin/bash
# Every GPU-only test (`-m gpu`), in one bounded run on a machine with CUDA and a CUDA build of
# torch. Wheels for what that machine lacks (engined's own, pyzmq, msgspec, openai, ...) may be
# put in .whl/ first; they are installed into the running python's environment without an
# index. Output: the test log, also under $OUT when that is set (the device tool's folder).
#   bash tests/gpu.sh [pytest args...]
set -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl \
        || exit 1
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv
"$PY" -c "import sys, torch, transformers, engined.engine; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), \
'transformers', transformers.__version__)" || exit 1
LOG=${OUT:-/tmp}/gpu-tests.log
PYTHONUNBUFFERED=1 timeout "${GPU_TESTS_TIMEOUT_S:-520}" "$PY" -m pytest -m gpu -p no:cacheprovider \
    -v -s --timeout 300 -o addopts="" tests/e2e/test_gpu.py "$@" 2>&1 | tee "$LOG" \
    | grep -v "^\[engined \|^(Main\|WARNING\|^INFO\|^\s*$"
