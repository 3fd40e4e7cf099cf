#!/usr/bin/env bash
# The CUDA MPS daemon for ranks that share one GPU (moe_overlap.launch backend="cuda"), in a
# private pipe / log directory, so it never touches another user's MPS. Never changes the GPU's
# compute mode. Needs root (or the GPU's owner) to start.
#
#   eval "$(bash scripts/mps.sh start)"   # starts it; prints the exports the ranks need
#   bash scripts/mps.sh status            # running or not (exit 0 / 1)
#   bash scripts/mps.sh stop              # quits it (also when it was started by another shell)
#
# MOE_MPS_DIR (default /tmp/moe-overlap-mps) holds pipe/ and log/. Every process that should run
# under MPS needs CUDA_MPS_PIPE_DIRECTORY (and CUDA_MPS_LOG_DIRECTORY) as printed by `start`.
set -uo pipefail
dir=${MOE_MPS_DIR:-/tmp/moe-overlap-mps}
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
ctl() { echo "$1" | nvidia-cuda-mps-control 2>&1; }
running() { [ -S "$CUDA_MPS_PIPE_DIRECTORY/control" ] && ctl get_server_list >/dev/null; }
case "${1:-}" in
start)
    command -v nvidia-cuda-mps-control >/dev/null || { echo "mps.sh: nvidia-cuda-mps-control not found" >&2; exit 1; }
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if ! running; then
        nvidia-cuda-mps-control -d || { echo "mps.sh: the MPS daemon did not start (log: $CUDA_MPS_LOG_DIRECTORY)" >&2; exit 1; }
        for _ in $(seq 50); do running && break; sleep 0.1; done
        running || { echo "mps.sh: the MPS daemon does not answer (log: $CUDA_MPS_LOG_DIRECTORY)" >&2; exit 1; }
    fi
    echo "export CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY"
    ;;
stop)
    if running; then ctl quit >/dev/null; fi
    for _ in $(seq 50); do running || break; sleep 0.1; done
    running && { echo "mps.sh: the MPS daemon is still running" >&2; exit 1; }
    exit 0
    ;;
status)
    if running; then echo "MPS running ($CUDA_MPS_PIPE_DIRECTORY)"; exit 0; fi
    echo "MPS not running ($CUDA_MPS_PIPE_DIRECTORY)"; exit 1
    ;;
*)
    echo "usage: mps.sh start|stop|status" >&2; exit 2 ;;
esac
