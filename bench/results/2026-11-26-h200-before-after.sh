#!/bin/bash
# Runs on the lent machine from the repo root (carry .whl). Stage 1: issue 28's world-2
# small cells, before (f9e0322) and after (HEAD) in turn, 3 rounds; stage 2: GPU tests;
# stage 3: the wider before/after table (shm w2/4/8, tcp w2/4).
cd "$(dirname "$0")/.."
PY=${PY:-python3}
BIN=$(dirname "$($PY -c 'import sys;print(sys.executable)')")
export PATH=$BIN:$PATH OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
B=${BUDGET:-0.4}
if [ "${LOCAL:-0}" != 1 ]; then
  $PY -m pip install --no-deps -q .whl/mpich-*.whl .whl/mpi4py-*.whl 2>&1 | tail -2
  mkdir -p /tmp/b && tar -xf .whl/before.tar -C /tmp/b
  ($PY setup.py build_ext --inplace -q -j 8 > $OUT/build.log 2>&1) &
  (cd /tmp/b && $PY setup.py build_ext --inplace -q > /tmp/build-before.log 2>&1) &
  wait; tail -3 /tmp/build-before.log >> $OUT/build.log
fi
which mpiexec; nproc; uptime; git log -1 --format=%h 2>/dev/null; $PY -c 'import mpi4py,numpy;print(mpi4py.__version__, numpy.__version__)'
ls collectives/*.so /tmp/b/collectives/*.so | wc -l
pair() {  # tree world label args...
  local T=$1 W=$2 L=$3; shift 3
  local D=$PWD; [ $T = before ] && D=/tmp/b
  rm -f /tmp/rows.jsonl
  PYTHONPATH=$D timeout 120 mpiexec -n $W $PY .whl/bench_pair.py --budget $B --json /tmp/rows.jsonl "$@" > /dev/null 2>/tmp/err.txt \
    || { echo "FAILED $T w$W $L"; tail -5 /tmp/err.txt; }
  [ -f /tmp/rows.jsonl ] && sed "s/^{/{\"tree\": \"$T\", \"label\": \"$L\", /" /tmp/rows.jsonl >> $OUT/rows.jsonl
}
t0=$(date +%s)
for R in 1 2 3; do for T in before after; do
  pair $T 2 "small-r$R" --backend gloo --ops all_reduce,broadcast --sizes 4,1024,65536
done; done
echo "stage1 $(( $(date +%s) - t0 )) s"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_nccl.py \
    "tests/test_master_worker.py::test_cuda_on_a_worker_makes_a_device_tensor_there" -rs 2>&1 | tail -8
fi
echo "stage2 $(( $(date +%s) - t0 )) s"
for W in 2 4 8; do for T in before after; do
  pair $T $W shm --backend gloo --ops all_reduce,broadcast,all_gather,barrier --sizes 4,1024,65536,1048576,16777216
done; done
echo "stage3a $(( $(date +%s) - t0 )) s"
for W in 2 4; do for T in before after; do
  COLLECTIVES_TRANSPORT=tcp pair $T $W tcp --backend gloo --ops all_reduce,broadcast,all_gather,barrier --sizes 4,1024,65536,1048576
done; done
echo "stage3b $(( $(date +%s) - t0 )) s"
$PY .whl/check_pair.py $OUT/rows.jsonl | tail -3
ls $OUT
