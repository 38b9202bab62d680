#!/bin/bash
# The GPU check in one device command: build the CUDA tree from the carried sdist, then run the check
# until the command's limit, everything under $OUT. The device machine has no network and lacks cffi
# and gguf, so prepare here first (once per checkout), then run it with `.gpu` carried:
#
#   echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu/cache/sdist .gpu/whl
#   cp ~/.cache/pyllamapool/sdist/xllamacpp-*.tar.gz .gpu/cache/sdist/     # python build.py fetches it
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .gpu/whl cffi==2.0.0 pycparser==3.0 gguf==0.19.0
#
#   device run: bash benchmarks/gpu-lease.sh        (carry .gpu, timeout_s 600)
#
# or in two commands on the same warm machine, so that the run is not squeezed into what one
# command's 600 s leave after the build (the plan's steps take about 550 s at Qwen3-30B-A3B's shape):
#
#   device run: bash benchmarks/gpu-lease.sh build  (carry .gpu, timeout_s 400)
#   device run: bash benchmarks/gpu-lease.sh run    (no carry needed; timeout_s 600)
#
# Nothing else may sit in .gpu: a model cached there would travel too. BUDGET (default 580 s) is the
# command's limit less a margin; the run's deadline is what the build leaves of it.
set -u
PHASE=${1:-all}
T0=$SECONDS
OUT=${OUT:?run this where the device tool sets OUT}
if [ -z "${NO_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYLLAMAPOOL_CACHE=$PWD/.gpu/cache
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  nproc; free -g; python3 --version; nvcc --version | tail -1; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ "$PHASE" != run ]; then
  python3 benchmarks/gpu_check.py build --target cuda --arch "${ARCH:-90}" --jobs "$(nproc)" > "$OUT/build.log" 2>&1
  rc=$?
  tail -5 "$OUT/build.log"
  echo "build rc=$rc after $((SECONDS - T0)) s"
  [ $rc = 0 ] || exit $rc
  [ "$PHASE" = build ] && exit 0
fi
deadline=$((${BUDGET:-580} - (SECONDS - T0)))
echo "run deadline $deadline s"
python3 benchmarks/gpu_check.py run --out "$OUT/gpu-check.json" --deadline-s "$deadline" > "$OUT/run.log" 2>&1
rc=$?
tail -c 9000 "$OUT/run.log"
echo "run rc=$rc after $((SECONDS - T0)) s"
