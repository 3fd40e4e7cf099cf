"""Deprecated alias of `moe_overlap.combine.reference` (the module moved there)."""
import warnings

from .combine.reference import *  # noqa: F401,F403

warnings.warn("moe_overlap.reference is deprecated: import from moe_overlap.combine.reference (or "
              "moe_overlap.combine)", DeprecationWarning, stacklevel=2)
