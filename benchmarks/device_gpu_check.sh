#!/usr/bin/env bash
# Issue 40's checks on a lent GPU machine, in one run (the device tool's `run`, carry [".devray"]):
#   1. the machine, its Python packages, the Ray bundle (../shared/tools/device_ray_bundle.sh builds .devray/);
#   2. tests/test_cuda.py and the gpu-marked tests of tests/test_units.py, raydl from this tree;
#   3. benchmarks/bench_gpu.py (limits, transfer-bound loop, classifier step);
#   4. benchmarks/probe_h2d_sources.py (where the rest of the copy engine's rate goes).
# Everything goes to $OUT (run.log, pytest.log, junit.xml, bench_gpu.json, bench_gpu.md, probe.json).
#   bash benchmarks/device_gpu_check.sh            # on the device; OUT defaults to /tmp/out elsewhere
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
echo "== machine ($(date -u +%FT%TZ))"
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max,memory.total \
  --format=csv 2>&1 | tail -2
echo "cpus $(nproc)"; free -g | head -2; df -h /dev/shm /tmp | tail -2
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
python3 -m pip list 2>/dev/null | grep -iE "^(pytest|pytest-timeout|hypothesis|numpy|pyarrow|torch) " || true
echo "== Ray bundle"
bundle=${RAYDL_DEVRAY:-.devray}  # the carried bundle; run from a copy of the tree: RAYDL_DEVRAY=../.devray
mkdir -p /tmp/site && tar -xJf "$bundle/ray.tar.xz" -C /tmp/site \
  && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$bundle"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import ray, raydl; print('ray', ray.__version__, '| raydl from', raydl.__file__)" || exit 1
echo "== tests (gpu-marked: tests/test_cuda.py, tests/test_units.py)"
RAYDL_TEST_NO_DASHBOARD=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -o timeout=180 \
  --junitxml="$OUT/junit.xml" tests/test_cuda.py tests/test_units.py 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit ${PIPESTATUS[0]}"
echo "== bench_gpu"
# Ray's object store in /dev/shm where it fits (else Ray takes /tmp, slower): a proportion of RAM that fits there.
prop=$(python3 -c "
import os, shutil
shm = shutil.disk_usage('/dev/shm').free if os.path.isdir('/dev/shm') else 0
ram = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
print(round(max(0.01, min(0.1, 0.8 * shm / ram)), 3))")
echo "object store: $prop of RAM"
RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=$prop timeout 270 python3 -m benchmarks.bench_gpu --reps 2 \
  --json "$OUT/bench_gpu.json"
echo "bench exit $?"
cp benchmarks/results/bench_gpu-2*.md "$OUT/bench_gpu.md" 2>/dev/null
echo "== probe_h2d_sources"
RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=$prop timeout 150 python3 -m benchmarks.probe_h2d_sources \
  --json "$OUT/probe.json"
echo "probe exit $?"
date -u +%FT%TZ
