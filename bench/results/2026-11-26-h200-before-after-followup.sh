#!/bin/bash
cd "$(dirname "$0")/.."
PY=python3
BIN=$(dirname "$($PY -c 'import sys;print(sys.executable)')")
export PATH=$BIN:$PATH OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
$PY -m pip install --no-deps -q .whl/mpich-*.whl .whl/mpi4py-*.whl 2>&1 | tail -2
rm -rf /tmp/b; mkdir -p /tmp/b && tar -xf .whl/before.tar -C /tmp/b
($PY setup.py build_ext --inplace -q -j 8 > /tmp/build.log 2>&1) &
(cd /tmp/b && $PY setup.py build_ext --inplace -q > /tmp/build-before.log 2>&1) &
wait
ls collectives/*.so /tmp/b/collectives/*.so | wc -l
pair() {
  local T=$1 W=$2 L=$3; shift 3
  local D=$PWD; [ $T = before ] && D=/tmp/b
  rm -f /tmp/rows.jsonl
  PYTHONPATH=$D timeout 60 mpiexec -n $W $PY .whl/bench_pair.py --json /tmp/rows.jsonl "$@" > /dev/null 2>/tmp/err.txt \
    || { echo "FAILED $T w$W $L"; tail -3 /tmp/err.txt; }
  [ -f /tmp/rows.jsonl ] && sed "s/^{/{\"tree\": \"$T\", \"label\": \"$L\", /" /tmp/rows.jsonl >> $OUT/rows.jsonl
}
t0=$(date +%s)
for R in 1 2; do for T in before after; do
  COLLECTIVES_TRANSPORT=tcp pair $T 4 "tcp-r$R" --backend gloo --ops all_gather,broadcast --sizes 1048576
  COLLECTIVES_TRANSPORT=tcp pair $T 2 "tcp-r$R" --backend gloo --ops all_reduce,all_gather --sizes 1048576
  pair $T 4 "shm-r$R" --backend gloo --ops all_gather --sizes 16777216
done; echo "round $R $(( $(date +%s) - t0 )) s"; done
