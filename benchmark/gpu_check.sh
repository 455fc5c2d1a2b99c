#!/usr/bin/env bash
# The GPU checks in one command, on a machine with one CUDA GPU and this repository installed (nothing to download):
# tests/test_gpu.py (every script with --cuda, --compile and --cudagraphs; graphs against eager; no sync inside an
# update; a GPU checkpoint resumed on the CPU; model.pt loaded without CUDA), then the speed table of all five scripts
# on the GPU, eager / compile / cudagraphs / compile+cudagraphs (benchmark/speed.py's workload, 3000 updates, one run
# each). Writes the test summary and the table to OUT (default benchmark/results/gpu_check_DATE.md).
#
#     bash benchmark/gpu_check.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmark/results/gpu_check_$(date +%F).md}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'" || exit 1
mkdir -p "$(dirname "$out")"
{
  echo "# GPU check, $(date -u '+%F %H:%M UTC'): $(python -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__)')"
  echo
  echo '```'
  python -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tail -25
  echo '```'
} > "$out" || true
python benchmark/speed.py --devices cuda --modes eager compile cudagraphs compile+cudagraphs --updates 3000 \
  --repeats 1 --out "$out"
cat "$out"
