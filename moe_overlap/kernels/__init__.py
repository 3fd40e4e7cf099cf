"""CuTe DSL kernels (imported lazily: this package needs only the standard library)."""


def reject_unknown_options(what: str, options: dict, allowed) -> None:
    """ValueError naming the keys of ``options`` outside ``allowed`` (a kernel's keyword options
    that a layer passes through; the keys the layer sets itself are not allowed)."""
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise ValueError(f"{what}: unknown or reserved keys {bad}; allowed: {sorted(allowed)}")
