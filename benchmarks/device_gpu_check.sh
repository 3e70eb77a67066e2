#!/usr/bin/env bash
# The checks of the GPU issues (40, then 59) on a lent GPU machine, in one run (the device tool's `run`, carry
# [".devray"]); about 7-8 minutes on an H200 machine with 16 CPUs:
#   1. the machine, its Python packages, the Ray bundle (../shared/tools/device_ray_bundle.sh builds .devray/);
#   2. tests/test_cuda.py and the gpu-marked tests of tests/test_units.py, raydl from this tree;
#   3. `python -m benchmarks gpu`: bench_gpu.py (limits, transfer-bound loop, classifier step), recorded;
#   4. `python -m benchmarks h2d_sources`: probe_h2d_sources.py (where the rest of the copy engine's rate goes);
#   5. benchmarks/bench_arrow.py at 8 workers against Ray Data and the one-process ceiling, twice;
#   6. benchmarks/bench_streaming.py, numeric columns, 8 workers, moto and the proxy on 4 cores of their own. moto is
#      not on the device: give it wheels in .devray/moto/ (cp312; moto[server]'s full set is 51 MB, too much beside
#      Ray's 29 MB in the 64 MiB carry: moto, boto3, botocore, s3transfer, jmespath, werkzeug, flask, flask-cors,
#      blinker, itsdangerous, click, jinja2, markupsafe, xmltodict, responses, requests, urllib3, idna, certifi,
#      charset-normalizer, python-dateutil, six, cryptography, cffi, pycparser, pyyaml are 31 MB, untried there);
#      without them this step says so and is skipped.
# Everything goes to $OUT (run.log, pytest.log, junit.xml, bench_gpu.json, bench_gpu.md, probe.json, records/,
# arrow.log, streaming.log).
#   bash benchmarks/device_gpu_check.sh            # on the device; OUT defaults to /tmp/out elsewhere
#   SKIP_TO=5 bash benchmarks/device_gpu_check.sh  # steps 5 and 6 only (a rerun in what device time is left)
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
step=${SKIP_TO:-1}
if [ "$step" -le 2 ]; then
echo "== tests (gpu-marked: tests/test_cuda.py, tests/test_units.py)"
RAYDL_TEST_NO_DASHBOARD=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -o timeout=180 \
  --junitxml="$OUT/junit.xml" tests/test_cuda.py tests/test_units.py 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit ${PIPESTATUS[0]}"
fi
echo "== bench_gpu"
# Ray's object store in /dev/shm where it fits (else Ray takes /tmp, slower): a proportion of RAM that fits there.
prop=$(python3 -c "
import os, shutil
shm = shutil.disk_usage('/dev/shm').free if os.path.isdir('/dev/shm') else 0
ram = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
print(round(max(0.01, min(0.1, 0.8 * shm / ram)), 3))")
echo "object store: $prop of RAM"
if [ "$step" -le 4 ]; then
# through the runner: benchmarks/records/{gpu,h2d_sources}.json come back in $OUT/records/ (commit them, then
# `python -m benchmarks readme`)
RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=$prop timeout 270 python3 -m benchmarks gpu --reps 2 \
  --json "$OUT/bench_gpu.json"
echo "bench exit $?"
cp benchmarks/results/bench_gpu-2*.md "$OUT/bench_gpu.md" 2>/dev/null
echo "== probe_h2d_sources"
RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=$prop timeout 150 python3 -m benchmarks h2d_sources \
  --json "$OUT/probe.json"
echo "probe exit $?"
mkdir -p "$OUT/records" && cp benchmarks/records/gpu.json benchmarks/records/h2d_sources.json "$OUT/records/" 2>/dev/null
fi
echo "== bench_arrow, 8 workers (twice)"
for round in 1 2; do
  RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=$prop timeout 150 python3 -m benchmarks.bench_arrow --workers 8 \
    --epochs 3 --loaders ceiling,raydl-columnar,ray-data,ceiling 2>&1 | grep -E '^\||"loader"' | tee -a "$OUT/arrow.log"
done
echo "== bench_streaming, numeric, 8 workers, storage on cores 12-15"
if ! python3 -c "import moto.server" 2>/dev/null && [ -d "$bundle/moto" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$bundle"/moto/*.whl
fi
if python3 -c "import moto.server" 2>/dev/null; then
  RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=$prop timeout 240 python3 -m benchmarks.bench_streaming --columns numeric --rows 2048 --batch-size 1024 \
    --workers 8 --storage-cores 12-15 --skip naive --png '' > "$OUT/streaming.log" 2>&1
  echo "bench exit $?"
  grep -vE '^\{|INFO|WARNING' "$OUT/streaming.log" | tail -14
else
  echo "skipped: no moto here, and none in $bundle/moto (see this script's header)"
fi
date -u +%FT%TZ
