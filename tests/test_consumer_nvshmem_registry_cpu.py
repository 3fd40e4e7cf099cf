"""The nvshmem consumer's compiled library against NVSHMEM's table of registered libraries (CPU,
with stand-ins at the two boundaries: CuTe DSL's compile and nvshmem4py's registration).

What the stand-ins model (read in the installed packages, bench/NOTES.md "Session 20: the
one-process crash of test_overlap_gpu, by reading"): ``cute_compile_helper`` compiles, loads the
CUDA library and calls ``library_init``, which hands NVSHMEM the address of the library's device
state; NVSHMEM keeps that address (not the library) and writes its state there only when its
table grows. CuTe DSL unloads the library once the compiled function is garbage-collected, and
nothing removes the address from NVSHMEM's table. So the properties checked: a registered library
stays loaded whatever happens to the Consumer objects that used it, and one build is registered
once per NVSHMEM initialisation (a second library of the same build, loaded where the dropped one
was, would find its address already counted and keep a zeroed device state).
"""
import gc
import sys
import types
import weakref

import pytest

from moe_overlap.combine import consumer as C
from moe_overlap.runtime.nvshmem import NvshmemRuntime


class _Library:
    """A loaded CUDA library: unloaded when the last reference to it goes."""


@pytest.fixture
def registered(monkeypatch):
    """NVSHMEM's table of registered libraries as weak references (it keeps none alive); the
    consumer built and compiled through stand-ins, as on a GPU machine."""
    table = []

    def cute_compile_helper(launch, *args):
        lib = _Library()
        table.append(weakref.ref(lib))

        def fn(*ints):
            return None
        fn.library = lib  # the compiled function owns its library
        return fn, types.SimpleNamespace(handle=id(lib), _keepalive=fn)

    mod = types.ModuleType("nvshmem.core.interop.cute")
    mod.cute_compile_helper = cute_compile_helper
    monkeypatch.setitem(sys.modules, "nvshmem.core.interop.cute", mod)
    monkeypatch.setattr(C, "_have_gpu", lambda: True)
    monkeypatch.setattr(C, "build_consumer", lambda *a, **k: object())
    monkeypatch.setattr(C, "consumer_example_args", lambda: [])
    monkeypatch.setattr(C, "_NVSHMEM_COMPILED", {}, raising=False)  # a fresh process
    return table


def test_registered_library_outlives_the_consumers_that_used_it(registered):
    # two layers of one process, one after the other (tests/test_overlap_gpu.py's configs
    # nvshmem_pieces then nvshmem_aligned: the first layer dropped before the second compiles)
    c = C.Consumer("nvshmem")
    c.compile()
    del c
    gc.collect()
    c = C.Consumer("nvshmem", timeout_ns=200_000_000)
    c.compile()
    del c
    gc.collect()
    assert registered, "nothing was registered with NVSHMEM"
    dead = [i for i, r in enumerate(registered) if r() is None]
    assert not dead, f"registered libraries {dead} were unloaded while NVSHMEM holds them"


def test_one_registration_per_build(registered):
    fns = [C.Consumer("nvshmem", timeout_ns=t).compile() for t in (10**9, 10**10, 2 * 10**8)]
    assert len(registered) == 1  # timeout_ns is a launch argument, not part of the build
    assert all(f is fns[0] for f in fns)
    C.Consumer("nvshmem", local_copy=False).compile()  # another build: its own library
    C.Consumer("nvshmem", unroll=2).compile()
    assert len(registered) == 3


def test_a_new_nvshmem_init_registers_anew(registered, monkeypatch):
    C.Consumer("nvshmem").compile()
    monkeypatch.setattr(NvshmemRuntime, "inits", NvshmemRuntime.inits + 1)
    C.Consumer("nvshmem").compile()  # the old library holds the old initialisation's state
    assert len(registered) == 2
    assert all(r() is not None for r in registered)


def test_nvlink_consumer_registers_nothing(registered, monkeypatch):
    monkeypatch.setattr(C, "compile_consumer", lambda *a, **k: (lambda *ints: None))
    C.Consumer("nvlink").compile()
    assert registered == []
