"""A module a spawned process imports while it unpickles its function (tests/test_launch_cpu.py):
what the environment held at that moment, before any of the rank's code runs, as a rank's first
CUDA initialisation (a module-level device count) would see it."""
import os

AT_IMPORT = {k: os.environ.get(k) for k in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                             "MOE_OVERLAP_RANKS_PER_GPU")}


def env_at_import(queue):
    queue.put(AT_IMPORT)
