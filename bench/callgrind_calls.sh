#!/bin/bash
# usage: bench/callgrind_calls.sh TREE LABEL [PYTHON]
# Instructions per call of six small collectives, the package imported from TREE (a
# checkout with its extensions built in place); see bench/callgrind_calls.py.
set -eu
TREE=$(cd "$1" && pwd); LABEL=$2; PY=${3:-$(dirname "$0")/../.venv/bin/python}
HERE=$(cd "$(dirname "$0")" && pwd); OUT=${CG_OUT:-/tmp/callgrind-calls}; mkdir -p "$OUT"
for OP in broadcast all_reduce all_gather_into_tensor reduce_scatter_tensor barrier reduce; do
  for N in 0 5000; do
    PYTHONPATH=$TREE PYTHONHASHSEED=0 valgrind --tool=callgrind --separate-threads=yes \
      --callgrind-out-file="$OUT/cg.$LABEL.$OP.$N.%p" "$PY" "$HERE/callgrind_calls.py" $OP $N \
      >/dev/null 2>&1
  done
  a=$(grep -h "^totals:" "$OUT"/cg.$LABEL.$OP.5000.*-01 | tail -1 | awk '{print $2}')
  b=$(grep -h "^totals:" "$OUT"/cg.$LABEL.$OP.0.*-01 | tail -1 | awk '{print $2}')
  echo "$LABEL $OP $(( (a - b) / 5000 ))"
done
