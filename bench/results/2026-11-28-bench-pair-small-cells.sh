#!/bin/bash
# bench_pair's 4 B and 1 KiB cells, the branch point (93a1ea2, /tmp/ddp_base) against main, launches alternating
out=${1:-small_cells.jsonl}
: > $out
cd /tmp
for rep in 1 2 3; do
  for w in 2 4; do
    for tree in base main; do
      root=/work/main; [ $tree = base ] && root=/tmp/ddp_base
      echo "# rep $rep world $w $tree load $(cut -d' ' -f1 /proc/loadavg)" >&2
      timeout 300 /work/main/.venv/bin/mpiexec -n $w env PYTHONPATH=$root /work/main/.venv/bin/python /work/shared/tools/bench_pair.py --backend gloo --sizes 4,1024 --samples 9 \
        | sed "s/^{/{\"tree\": \"$tree\", \"world\": $w, \"rep\": $rep, /" >> $out
    done
  done
done
