"""Sweep and validate the overlapped MoE combine on the GPUs of one host (see moe_overlap/sweep.py;
also `moe-overlap sweep`)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if __name__ == "__main__":
    from moe_overlap.combine.sweep import main
    sys.exit(main())
