#!/usr/bin/env bash
# The GPU report on a lent GPU machine (docs/gpu.md): the machine's own python3 (torch, no diffusers),
# diffusers and importlib_metadata from wheels carried in .whl/, tomesd 0.1.3 from .refs/tomesd-0.1.3,
# this checkout on PYTHONPATH. Everything comes back in at most five files under $OUT.
#   BUDGET  the preset's budget in seconds (runs that would pass it are listed as not run)
#   LIMIT   a hard stop for the bench process, seconds; the report is rewritten after every run
set -u
OUT=${OUT:-bench-out/gpu-run}
BUDGET=${BUDGET:-400}
LIMIT=${LIMIT:-460}
ONLY=${ONLY:-}  # a comma-separated list of run titles' slugs: rerun only these (gpu_report.py's --only)
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOME_REFS_DIR=$PWD/.refs
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, diffusers, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); print('diffusers', diffusers.__version__); print('device', torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
  nproc
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
rm -rf /tmp/gpu-report
timeout -k 10 "$LIMIT" python3 -m tomesd bench --preset gpu --device cuda --budget "$BUDGET" --out /tmp/gpu-report \
  ${ONLY:+--only "$ONLY"} > "$OUT/bench.out" 2> "$OUT/bench.log"
code=$?
echo "bench exit $code"
tar czf "$OUT/gpu-report.tgz" -C /tmp gpu-report
cp /tmp/gpu-report/report.md "$OUT/" 2>/dev/null
tail -c 3000 "$OUT/bench.log"
cat "$OUT/report.md" 2>/dev/null | head -120
exit 0
