#!/usr/bin/env bash
# One short run on a CUDA machine: every gpu-marked test, the transfer benchmark on the GPU, then the
# overlap gain of the vLLM connector's copies by layer (scripts/bench_layer_copies.py).
#   bash scripts/gpu_check.sh            (from the repository root, after `make setup TORCH_SPEC=`
#                                         in a venv whose torch has CUDA)
# Fails if no CUDA device is visible: a GPU check that silently ran on the CPU would prove nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (torch %s); run this on a GPU machine" % torch.__version__)
print("gpu_check: torch", torch.__version__, "on", torch.cuda.get_device_name(0))
PYEOF
"$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 600 tests
"$PY" scripts/bench_transfer.py --json
"$PY" scripts/bench_layer_copies.py --json --runs 20
