#!/usr/bin/env bash
# One scripted GPU check per area, for the device machine (see ../shared/device/README.md for how
# the CuTe DSL / NVSHMEM parts get there; the tree there has no .git, so pass the commit):
#
#   source .devdeps/p2/setup.sh && GIT_COMMIT=<sha> bash scripts/gpu_check.sh <area> [quick]
#
# areas: gemm     grouped GEMM tests + bench (issue 3)
#        combine  consumer / overlap tests (nvshmem configs need part 0), the race validation
#                 test, the validation grid and the ccta x mgb sweep (issue 4; "quick": one
#                 shape, no sweep; "models": the sweep on the model shapes + a 1000-replay soak)
#        plan     planner GPU tests, the producer on packed plans (tests + bench_packed_gemm
#                 against torch._grouped_mm on the unpadded rows) and the planner's, prepare's
#                 and the ordered scale's per-routing tables' device time (bench_plan); one GPU
#        ffn      fused FFN / band all-reduce tests + bench_ffn + the compute-kernel breakdown
#                 (issue 5; "quick": 3 shapes, 10 rounds); also on one GPU: the band all-reduce
#                 with G ranks emulated on that GPU (tests + bench_band_allreduce_onegpu, a
#                 local-HBM emulation: the kernel's per-SM limit, not NVLink)
#        chained  chained FFN compute kernel tests (dense, grouped, ShardedExperts on it), the
#                 baseline compute, the kernel against it and the grouped call against torch's
#                 grouped GEMMs (one GPU; "t8192" / "t8192b": only the 8192-token orders
#                 under the activation cap, sustained: bench/NOTES.md, session 16)
#        layer    one MoE layer end to end, ours vs the same-scale sequential layer
#                 (bench_moe_layer, overlap backend, one rank per GPU: W = 1 on one GPU; four
#                 models at 4096 and 16384 tokens; "expert": also with the plans expert by
#                 expert; "library": also with the library's up-projection, --up library)
#        producer the producer grid as MoECombine launches it (bench_producer_models, the
#                 consumer beside it, one process per model, merged into one JSON; "quick": W
#                 = 2 at 4096 tokens only; $PRODUCER_VARIANTS: --variants, default "default";
#                 $PRODUCER_MODELS: a space-separated subset, one call each within a call's
#                 limit, merged after with bench_producer_models.py merge)
#        scale    the token-ordered scale alone (tests + bench_ordered_scale; one GPU) and,
#                 with 2 GPUs, scale="ordered" in the combine (tests/test_ordered_wire_gpu.py)
#        ranks    every two_gpus test module with W ranks as processes sharing one GPU (MPS
#                 started and stopped by scripts/mps.sh; time-sliced where it cannot start;
#                 "quick" = a comma-separated list of test files instead of all; "grid w2|w4|w8"
#                 = the combine's validation grid, soak and broken-ordering check at W ranks
#                 (scripts/ranks_grid.py, one part per device call); "faults" = the fault
#                 tests under MPS, then time-sliced)
# The combine area also runs the fault, recovery, producer-bounds and shared-buffer tests and
# the autotune test (one GPU for the W=1 ones).
# Logs and JSON go to $OUT (the device tool brings them back); a short summary is printed last.
# NVLink multicast stays off whatever the caller's environment says.
set -uo pipefail
area=${1:?usage: gpu_check.sh gemm|plan|combine|ffn|chained|layer|producer|scale|ranks [quick [part]]}
quick=${2:-}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export CUDA_MODULE_LOADING=EAGER
export OUT=${OUT:-/tmp/moe_overlap_out}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export GIT_COMMIT=${GIT_COMMIT:-unknown}
mkdir -p "$OUT"
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
# the card in the JSON names the chained benches write (the nvidia-h200 kind may run on H100s)
gpu_tag=$(python -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
summary=()

run() {  # run <name> <timeout s> <command...>: log to $OUT/<name>.log, keep its last line
    # SIGINT at the limit (to the command's process group), SIGKILL 30 s later: pytest stops
    # and still writes its junit file of the tests before the cut
    local name=$1 t=$2
    shift 2
    timeout -s INT -k 30 "$t" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-22s rc=%-3s %s' "$name" "$rc" "$(grep -v Warning "$OUT/$name.log" | tail -1)")")
    return $rc
}

case "$area" in
gemm)
    run gemm_tests 400 python -m pytest -q -p no:cacheprovider tests/test_grouped_gemm_gpu.py \
        tests/test_producer_bounds_gpu.py
    args=(--rounds 30)
    [ "$quick" = quick ] && args=(--quick)
    run gemm_bench 300 python bench/bench_grouped_gemm.py "${args[@]}" --tag boost --out "$OUT"
    # the same calls back to back (power-limited steady state; bench/NOTES.md, session 5)
    BENCH_LEAD_MS=0 run gemm_bench_b2b 300 python bench/bench_grouped_gemm.py "${args[@]}" \
        --tag back_to_back --out "$OUT"
    ;;
plan)
    run planner_tests 300 python -m pytest -q -p no:cacheprovider tests/test_planner_gpu.py \
        tests/test_plan_kernel_gpu.py
    run gemm_tests 400 python -m pytest -q -p no:cacheprovider tests/test_grouped_gemm_gpu.py
    args=()
    [ "$quick" = quick ] && args=(--models deepseek-v3 --worlds 2 --modes balanced --rounds 5)
    run packed_gemm_bench 450 python bench/bench_packed_gemm.py "${args[@]}" --out "$OUT"
    run plan_bench 400 python bench/bench_plan.py --out "$OUT"
    run upproj_bench 500 python bench/bench_upproj.py --quick --out "$OUT"  # issue 39 goal 3
    ;;
combine)
    heap=6G  # the synthetic shapes; the model shapes' receive buffers need far more
    [ "$quick" = models ] && heap=48G
    export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-$heap}
    run overlap_tests 400 python -m pytest -q -p no:cacheprovider tests/test_overlap_gpu.py \
        tests/test_planner_gpu.py tests/test_validation_gpu.py
    run fault_tests 590 python -m pytest -q -p no:cacheprovider tests/test_faults_gpu.py \
        tests/test_recover_gpu.py tests/test_producer_bounds_gpu.py tests/test_comm_buffer_gpu.py \
        tests/test_peer_error_gpu.py
    # MoECombine.autotune on the overlap backend at W=1 (order="auto" included; one GPU)
    run autotune_tests 400 python -m pytest -q -p no:cacheprovider tests/test_autotune_gpu.py
    if [ "$ngpu" -ge 2 ]; then
        if [ "$quick" = models ]; then
            run sweep_models 590 python scripts/sweep.py --shapes models --ccta 8,16 --mgb 2 \
                --autotune 0 --soak 1000 --out "$OUT/sweep_models.json"
            # the plans expert by expert (each expert's weights read once; bench/NOTES.md,
            # session 13): against remote_first on the same shapes
            run sweep_models_expert 590 python scripts/sweep.py --shapes models --ccta 8,16 \
                --mgb 2 --autotune 0 --order expert --out "$OUT/sweep_models_expert.json"
        elif [ "$quick" = quick ]; then
            run validate 400 python scripts/sweep.py --validate-only --shapes 4096x16x4x8192x1024 \
                --out "$OUT/validate.json"
        else
            run validate 500 python scripts/sweep.py --validate-only --out "$OUT/validate.json"
            run sweep 550 python scripts/sweep.py --autotune 1 --out "$OUT/sweep.json"
        fi
    fi
    ;;
ffn)
    run ffn_tests 500 python -m pytest -q -p no:cacheprovider tests/test_fused_ffn_gpu.py \
        tests/test_ffn_gpu.py tests/test_band_allreduce_gpu.py tests/test_band_allreduce_bf16_gpu.py
    # G ranks emulated on one GPU: runs with ngpu == 1 too
    run ar_onegpu_tests 300 python -m pytest -q -p no:cacheprovider \
        tests/test_band_allreduce_onegpu_gpu.py
    ar_args=()
    [ "$quick" = quick ] && ar_args=(--quick)
    run ar_onegpu_bench 300 python bench/bench_band_allreduce_onegpu.py "${ar_args[@]}" \
        --tag h200 --out "$OUT"
    if [ "$ngpu" -ge 2 ]; then
        args=(--rounds 100)
        [ "$quick" = quick ] && args=(--quick)
        # --hold-s: the sustained rate beside the interleaved one (bench/NOTES.md, session 15)
        run ffn_bench 550 torchrun --nproc-per-node "$ngpu" bench/bench_ffn.py "${args[@]}" \
            --fused-variants "chained:compute=chained" --hold-s 1 --out "$OUT"
    fi
    run fused_compute 300 python bench/bench_fused_compute.py --out "$OUT"
    ;;
chained)
    if [ "$quick" = t8192 ]; then  # two steps, under one device call's 600 s
        # the phased step under the bound (bench/NOTES.md, session 16: the DRAM model's search)
        run chained_cap_phased 300 python bench/bench_chained_compute.py --tokens 8192 \
            --groups auto,8p1r16l8s,6p1r18l6s,4p1s,8p4,16p4 --shuffle 3 --rounds 5 --hold-s 2 \
            --tag ${gpu_tag}_phased --out "$OUT"
        run chained_cap_dense 250 python bench/bench_chained_compute.py \
            --shapes deepseek-v3-dense --tokens 8192 --groups auto,4p4,8p4,8p4r24l8 \
            --shuffle 3 --rounds 5 --hold-s 2 --tag ${gpu_tag}_cap --out "$OUT"
    elif [ "$quick" = t8192b ]; then
        run chained_cap_lookahead 300 python bench/bench_chained_compute.py --tokens 8192 \
            --groups auto,16p4r32l16,16p4 --shuffle 3 --rounds 5 --hold-s 2 \
            --tag ${gpu_tag}_lookahead --out "$OUT"
    else
        run chained_tests 300 python -m pytest -q -p no:cacheprovider \
            tests/test_chained_ffn_gpu.py tests/test_sharded_experts_chained_gpu.py \
            -k "not cluster2 and not test_cluster_"
        run ffn_baseline 200 python bench/bench_ffn_baseline.py --out "$OUT"
        run chained_bench 300 python bench/bench_chained_compute.py --groups auto --shuffle 5 \
            --rounds 5 --hold-s 1.5 --out "$OUT"
        run chained_grouped_bench 300 python bench/bench_chained_grouped.py --out "$OUT"
        # the 2-CTA cluster variant (compiled, never yet run): last, with its own bound
        run chained_cluster_tests 200 python -m pytest -q -x -p no:cacheprovider \
            tests/test_chained_ffn_gpu.py -k "cluster2 or test_cluster_"
        run chained_cluster_bench 200 python bench/bench_chained_compute.py \
            --shapes llama3-70b --groups auto,16p4c2,8p4c2 --shuffle 3 --rounds 5 --hold-s 2 \
            --tag ${gpu_tag}_cluster --out "$OUT"
        # its two CTAs made to diverge (each case in a process of its own, killed if it
        # hangs): after the bench, so that a launch that misbehaves cannot disturb the
        # measurements
        MOE_TEST_OUT="$OUT" run chained_cluster_faults 300 python -m pytest -q \
            -p no:cacheprovider tests/test_chained_cluster_faults_gpu.py
    fi
    ;;
layer)
    # --backend overlap: "auto" picks the reference backend at W = 1 (one GPU)
    layer_args=(--backend overlap --shapes models --tokens 4096,16384)
    run layer_bench 590 torchrun --nproc-per-node "$ngpu" bench/bench_moe_layer.py \
        "${layer_args[@]}" --tag "${ngpu}x_${gpu_tag}_${GIT_COMMIT}" --out "$OUT"
    [ "$quick" = expert ] && run layer_bench_expert 590 torchrun --nproc-per-node "$ngpu" \
        bench/bench_moe_layer.py "${layer_args[@]}" --order expert \
        --tag "${ngpu}x_${gpu_tag}_expert_${GIT_COMMIT}" --out "$OUT"
    [ "$quick" = library ] && run layer_bench_library 590 torchrun --nproc-per-node "$ngpu" \
        bench/bench_moe_layer.py "${layer_args[@]}" --up library \
        --tag "${ngpu}x_${gpu_tag}_library_${GIT_COMMIT}" --out "$OUT"
    ;;
producer)
    # one process per model (a model's weights and plans freed before the next), then merged
    pargs=(--rounds 5 --beside consumer --variants "${PRODUCER_VARIANTS:-default}")
    [ "$quick" = quick ] && pargs+=(--worlds 2 --tokens 4096)
    parts=()
    for m in ${PRODUCER_MODELS:-deepseek-v3 qwen3-235b-a22b qwen3-30b-a3b mixtral-8x7b}; do
        run "producer_$m" "${PRODUCER_MODEL_TIMEOUT_S:-140}" python bench/bench_producer_models.py \
            --models "$m" "${pargs[@]}" --tag "grid_$m" --out "$OUT"
        parts+=("$(ls "$OUT"/producer_models_*_grid_"$m".json* 2>/dev/null | head -1)")
    done
    run producer_merge 60 python bench/bench_producer_models.py merge "${parts[@]}" \
        --out "$OUT/producer_models_${gpu_tag}_${GIT_COMMIT}_grid.json"
    ;;
scale)
    run ordered_scale_tests 300 python -m pytest -q -p no:cacheprovider \
        tests/test_scale_ordered_gpu.py
    if [ "$ngpu" -ge 2 ]; then  # scale="ordered" in the overlapped combine
        run ordered_wire_tests 400 python -m pytest -q -p no:cacheprovider \
            tests/test_ordered_wire_gpu.py
    fi
    run ordered_scale_bench 300 python bench/bench_ordered_scale.py \
        --shape 4096x16x4x8192x2048 --ccta 8,12,16 --out "$OUT"
    ;;
ranks)
    # every two_gpus test module with its ranks as processes sharing this machine's GPU(s)
    # (moe_overlap.launch backend="cuda"): under MPS where it starts, else time-sliced.
    # quick = a comma-separated list of test files (default: every module marked two_gpus);
    # "grid <part>" = the combine's validation grid, soak and broken-ordering check for part
    # w2 | w4 | w8 (scripts/ranks_grid.py: one part per device call, within its budget);
    # "faults" = tests/test_ranks_faults_gpu.py under MPS, then time-sliced (in $OUT/time_sliced);
    # $RANKS_K: a pytest -k expression, $RANKS_TAG: a suffix of the check's name (a module too
    # long for one call in two parts, merged after with scripts/ranks_report.py --merge)
    export MOE_OVERLAP_SHARE_GPU=1
    mode=time-sliced
    if [ "${MOE_RANKS_NO_MPS:-0}" != 1 ] && mps_env=$(bash scripts/mps.sh start); then
        eval "$mps_env"; mode=mps
    fi
    echo "ranks: $mode" > "$OUT/ranks_mode.txt"
    modules() {  # modules <out dir> <test files...>: one pytest run (and junit file) per module
        local d=$1 m name
        shift
        local sel=()
        [ -n "${RANKS_K:-}" ] && sel=(-k "$RANKS_K")
        for m in "$@"; do
            name=$(basename "$m" .py)
            name=${name#test_}${RANKS_TAG:+_$RANKS_TAG}
            OUT=$d run "ranks_$name" "${RANKS_TIMEOUT_S:-540}" python -m pytest -q \
                -p no:cacheprovider -rs -m two_gpus "${sel[@]}" --junitxml "$d/junit_$name.xml" "$m"
            if [ $? -eq 124 ]; then  # cut: a failing check of its own says so in the report
                printf '%s' '<?xml version="1.0" encoding="utf-8"?>' \
                    "<testsuites><testsuite name=\"$name\"><testcase classname=\"$name\"" \
                    " name=\"finished_within_the_limit\"><failure message=\"cut by the time" \
                    " limit (${RANKS_TIMEOUT_S:-540} s): the tests after the cut did not run;" \
                    " junit_$name.xml holds those before it\"/></testcase></testsuite>" \
                    "</testsuites>" > "$d/junit_${name}_cut.xml"
            fi
        done
    }
    if [ "$quick" = grid ]; then
        part=${3:-w2}
        run "ranks_grid_$part" "${RANKS_GRID_TIMEOUT_S:-560}" python scripts/ranks_grid.py "$part" \
            --out "$OUT" --budget-s "${RANKS_GRID_BUDGET_S:-510}" --mode "$mode"
    elif [ "$quick" = faults ]; then
        modules "$OUT" tests/test_ranks_faults_gpu.py
        if [ "$mode" = mps ]; then  # the same faults time-sliced, reported on their own
            bash scripts/mps.sh stop
            mode=time-sliced
            (
                unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
                mkdir -p "$OUT/time_sliced"
                echo "ranks: time-sliced" > "$OUT/time_sliced/ranks_mode.txt"
                modules "$OUT/time_sliced" tests/test_ranks_faults_gpu.py
                python scripts/ranks_report.py "$OUT/time_sliced" \
                    > "$OUT/time_sliced/ranks_report.log" 2>&1
                printf '%s\n' "${summary[@]}" > "$OUT/time_sliced/summary.txt"
            )
            summary+=("$(tail -1 "$OUT/time_sliced/summary.txt")")
            summary+=("time-sliced: $(tail -1 "$OUT/time_sliced/ranks_report.log")")
        fi
    else
        if [ -n "$quick" ]; then
            IFS=, read -r -a mods <<< "$quick"
        else
            mapfile -t mods < <(grep -l "two_gpus" tests/test_*gpu.py)
        fi
        modules "$OUT" "${mods[@]}"
    fi
    [ "$mode" = mps ] && bash scripts/mps.sh stop
    python scripts/ranks_report.py "$OUT" > "$OUT/ranks_report.log" 2>&1
    summary+=("ranks mode: $(cut -d' ' -f2 "$OUT/ranks_mode.txt"); $(tail -1 "$OUT/ranks_report.log")")
    ;;
*)
    echo "unknown area $area (gemm | plan | combine | ffn | chained | layer | producer | scale | ranks)" >&2
    exit 2
    ;;
esac

echo "== gpu_check $area $quick (commit $GIT_COMMIT, $ngpu GPUs) -> $OUT"
printf '%s\n' "${summary[@]}"
