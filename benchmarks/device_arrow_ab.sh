#!/usr/bin/env bash
# Issue 38's in-memory table on a lent machine's CPUs, raydl at this tree against raydl at a base commit, in one run
# of the device tool (`run`, carry [".devray"]), then the GPU tests at this tree:
#   git archive BASE raydl > .devray/base.tar             # here, before the run (.devray/: device_ray_bundle.sh)
#   bash benchmarks/device_arrow_ab.sh                    # on the device; OUT defaults to /tmp/out elsewhere
# 1. bench_arrow (ceiling, raydl-columnar) at 8 and 2 workers, base and this tree alternated, twice each;
# 2. bench_arrow_cost at 8 workers (the trainer's CPU per batch), base and this tree;
# 3. tests/test_cuda.py and the gpu-marked tests of tests/test_units.py at this tree.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
echo "== machine ($(date -u +%FT%TZ)): cpus $(nproc)"
bundle=${RAYDL_DEVRAY:-.devray}
mkdir -p /tmp/site && tar -xJf "$bundle/ray.tar.xz" -C /tmp/site \
  && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$bundle"/*.whl || exit 1
rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf "$bundle/base.tar" -C /tmp/base && cp -r benchmarks /tmp/base/ || exit 1
export PYTHONUNBUFFERED=1
here=/tmp/site:$PWD
base=/tmp/site:/tmp/base
for w in 8 2; do
  for round in 1 2; do
    for side in base here; do
      if [ $side = base ]; then pp=$base; dir=/tmp/base; else pp=$here; dir=$PWD; fi
      echo "== bench_arrow workers=$w round=$round side=$side"
      (cd $dir && PYTHONPATH=$pp timeout 120 python3 -m benchmarks.bench_arrow --workers $w --epochs 3 \
        --loaders ceiling,raydl-columnar 2>&1 | grep '"loader"')
    done
  done
done
for side in base here; do
  if [ $side = base ]; then pp=$base; dir=/tmp/base; else pp=$here; dir=$PWD; fi
  echo "== bench_arrow_cost workers=8 side=$side"
  (cd $dir && PYTHONPATH=$pp timeout 120 python3 -m benchmarks.bench_arrow_cost --workers 8 2>&1 | tail -12)
done
echo "== tests (gpu-marked: tests/test_cuda.py, tests/test_units.py)"
PYTHONPATH=$here RAYDL_TEST_NO_DASHBOARD=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
  -o timeout=180 tests/test_cuda.py tests/test_units.py > "$OUT/pytest.log" 2>&1; tail -3 "$OUT/pytest.log"
date -u +%FT%TZ
