"""Deprecated alias of `moe_overlap.combine.dispatch` (the module moved there)."""
import warnings

from .combine.dispatch import *  # noqa: F401,F403

warnings.warn("moe_overlap.dispatch is deprecated: import from moe_overlap.combine.dispatch (or "
              "moe_overlap.combine)", DeprecationWarning, stacklevel=2)
