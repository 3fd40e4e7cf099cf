#!/usr/bin/env bash
# The one-process crash of tests/test_overlap_gpu.py with 2 ranks sharing one GPU (bench/NOTES.md,
# "Session 20: the one-process crash of test_overlap_gpu, by reading"), in one device call:
#   1. probe: scripts/nvshmem_registry_probe.py (the stale NVSHMEM registration, old and fixed
#      path; no kernel launched);
#   2. pair:  the two configs that compile the same nvshmem consumer build back to back, the
#      first layer dropped in between (nvshmem_pieces, nvshmem_aligned): crashed before the fix
#      by the reading, must pass;
#   3. whole: every config in one process (what crashed in session 20): must pass;
#   4. only if 3 failed: the shortest failing prefix of the configs' order, by bisection (the
#      config that ends it is the one to look at), while the time budget lasts.
# Each run prints one line: its exit code, pytest's last line, and whether a log holds "illegal
# memory access". Logs go to $OUT/ranks_bisect.log (one file), the lines to
# $OUT/ranks_bisect_summary.txt.
#
#   source .devdeps/p2/setup.sh && GIT_COMMIT=<sha> bash scripts/ranks_bisect.sh [budget_s]
#
# budget_s (default 510): no run starts after it (a device command may run 600 s).
set -uo pipefail
budget=${1:-510}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export CUDA_MODULE_LOADING=EAGER MOE_OVERLAP_SHARE_GPU=1
export OUT=${OUT:-/tmp/moe_overlap_out}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p "$OUT"
log=$OUT/ranks_bisect.log summary=$OUT/ranks_bisect_summary.txt
: > "$log"; : > "$summary"
start=$SECONDS
# the configs of tests/test_overlap_gpu.py (_worker), in their order
configs=(nvlink torchprod nvshmem nvlink_v2 nvshmem_v2 nvlink_tma torchprod_v2 nvlink_v2_pieces
         nvshmem_pieces nvshmem_aligned nvlink_v2_aligned)
for c in "${configs[@]}"; do
    grep -q "(\"$c\"," tests/test_overlap_gpu.py || { echo "config $c is not in the test file" >&2; exit 2; }
done

say() { echo "$*" | tee -a "$summary"; }

mode=time-sliced
if [ "${MOE_RANKS_NO_MPS:-0}" != 1 ] && mps_env=$(bash scripts/mps.sh start); then
    eval "$mps_env"; mode=mps
fi
say "ranks_bisect: commit ${GIT_COMMIT:-unknown}, $mode, $(python -c 'import torch; print(torch.cuda.get_device_name())')"

NOT_RUN=200
run() {  # run <name> <command...>: bounded by what is left of the budget; 0 = passed,
         # NOT_RUN = not started (budget spent), else failed (124: timed out)
    local name=$1 left=$((budget - (SECONDS - start)))
    shift
    if [ "$left" -lt 60 ]; then say "$name: not run (budget spent)"; return $NOT_RUN; fi
    [ "$left" -gt 300 ] && left=300
    echo "===== $name ($*) =====" >> "$log"
    local t0=$SECONDS
    timeout "$left" "$@" > "$OUT/.run.log" 2>&1
    local rc=$?
    cat "$OUT/.run.log" >> "$log"
    local ima=no
    grep -qi "illegal memory access" "$OUT/.run.log" && ima=yes
    say "$(printf '%-28s rc=%-3s %4ss ima=%-3s %s' "$name" "$rc" "$((SECONDS - t0))" "$ima" \
        "$(grep -v Warning "$OUT/.run.log" | tail -1)")"
    rm -f "$OUT/.run.log"
    return $rc
}

overlap() {  # overlap <name> <configs, comma-separated>: the test file on those configs
    local name=$1
    MOE_TEST_CONFIGS=$2 run "$name" python -m pytest -q -p no:cacheprovider -rs -m two_gpus \
        tests/test_overlap_gpu.py
}

run probe python scripts/nvshmem_registry_probe.py "${PROBE_RANKS:-2}"
grep -h "theory" "$log" | tail -2 | tee -a "$summary"
overlap pair nvshmem_pieces,nvshmem_aligned
all=$(IFS=,; echo "${configs[*]}")
if ! overlap whole "$all"; then
    lo=0 hi=${#configs[@]}  # a prefix of lo configs passes (none: trivially), of hi fails
    while [ $((hi - lo)) -gt 1 ]; do
        mid=$(((lo + hi) / 2))
        prefix=$(IFS=,; echo "${configs[*]:0:$mid}")
        overlap "prefix_$mid" "$prefix"
        rc=$?
        if [ "$rc" -eq 0 ]; then lo=$mid; elif [ "$rc" -eq "$NOT_RUN" ]; then break; else hi=$mid; fi
    done
    say "shortest failing prefix (so far): ${hi} configs, ending at ${configs[$((hi - 1))]}; a prefix of $lo passed"
fi
[ "$mode" = mps ] && bash scripts/mps.sh stop
say "ranks_bisect: done in $((SECONDS - start)) s"
