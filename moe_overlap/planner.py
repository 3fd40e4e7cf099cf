"""Deprecated alias of `moe_overlap.combine.plan` (the module moved there)."""
import warnings

from .combine.plan import *  # noqa: F401,F403

warnings.warn("moe_overlap.planner is deprecated: import from moe_overlap.combine.plan (or "
              "moe_overlap.combine)", DeprecationWarning, stacklevel=2)
