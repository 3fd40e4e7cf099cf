"""Device timestamps: a one-thread CuTe DSL kernel that stores ``%globaltimer`` into a slot of an
int64 table, launched in stream order between other kernels (inside a CUDA graph too), so that
the phases of one call are timed on the device's clock where events cannot separate them (two
streams inside one graph replay).

Layout: ``table`` int64 [rows, slots], ``counter`` int32 [1], both on the device, zeroed by the
host. A call's first stamp (``first=True``) adds 1 to the counter; every stamp writes row
``(counter - 1) mod rows``, slot ``slot``. So call n (from 1) of a graph replayed many times has
row (n - 1) mod rows of its own with no host work per call; stamps of one call launched on
other streams must be ordered after its first stamp (an event wait), else they may read the
previous call's count.

What a stamp measures: the kernel reads the timer as its first instruction, so it runs when the
work before it on its stream is done (its grid retired) plus a kernel launch gap (a few us), and
the work after it on its stream starts one launch gap after it. An interval between two stamps
thus includes up to two launch gaps beside the work between them.

Clock: ``%globaltimer`` counts nanoseconds, the same clock on every SM, but the PTX ISA leaves
its update step to the implementation: it has been observed to advance in steps of about 1 us
on recent parts (finer on some, or while a profiler is attached), so a single stamp interval is
good to about one step. ``timer_step_ns`` estimates the step from the stamps taken (the gcd of
their differences). Zero never comes from the clock: a row with a zero slot was not stamped.

``stamp_reference`` is the kernel's effect in torch (the CPU stand-in and the tests' model).
"""

import math


def stamp_reference(table, counter, slot: int, first: bool, now_ns: int) -> None:
    """What the kernel does, in torch, at clock value ``now_ns`` (any device)."""
    n = int(counter[0]) + (1 if first else 0)
    if first:
        counter[0] = n
    rows = table.shape[0]
    table[(n - 1 + rows) % rows, slot] = int(now_ns)


def timer_step_ns(stamps) -> int | None:
    """The gcd of the differences between the distinct non-zero stamps given (any iterable of
    ints): the clock's update step once enough stamps were taken (a multiple of it before);
    None with fewer than two distinct stamps."""
    vals = sorted({int(v) for v in stamps if int(v) != 0})
    g = 0
    for a, b in zip(vals, vals[1:]):
        g = math.gcd(g, b - a)
    return g or None


def build_stamp():
    """@cute.jit launcher of the stamp kernel: (table, counter, rows, slots, slot, first,
    stream); one CTA of one thread."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from . import primitives as P

    @cute.kernel
    def stamp_kernel(table: Int64, counter: Int64, rows: Int32, slots: Int32, slot: Int32,
                     first: Int32):
        now = P.globaltimer()  # first: the moment the kernel runs
        n = P.ld_s32(counter)
        if first != Int32(0):
            n = n + Int32(1)
            P.st_s32(counter, n)
        row = (n - Int32(1) + rows) % rows
        P.st_s64(table + (Int64(row) * Int64(slots) + Int64(slot)) * Int64(8), now)

    @cute.jit
    def launch(table: Int64, counter: Int64, rows: Int32, slots: Int32, slot: Int32,
               first: Int32, stream: cuda.CUstream):
        stamp_kernel(table, counter, rows, slots, slot, first).launch(
            grid=[1, 1, 1], block=[1, 1, 1], stream=stream)

    return launch


def stamp_example_args():
    """Example arguments of the launcher (types only), for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(0), Int32(1), Int32(1), Int32(0), Int32(0), cuda.CUstream(0)]


_COMPILED = None  # the process's compiled launcher (one for every table)


def compiled_stamp():
    global _COMPILED
    if _COMPILED is None:
        import cutlass.cute as cute
        _COMPILED = cute.compile(build_stamp(), *stamp_example_args())
    return _COMPILED


class DeviceStamps:
    """A stamp table of ``rows`` calls x ``slots`` stamps and its call counter on ``device``;
    ``stamp`` launches the kernel (never synchronizes; capturable), ``last_calls`` reads the
    stamps back."""

    def __init__(self, rows: int, slots: int, device):
        import torch
        if rows < 1 or slots < 1:
            raise ValueError(f"rows={rows} and slots={slots} must be >= 1")
        self.rows, self.slots = int(rows), int(slots)
        self.table = torch.zeros(self.rows, self.slots, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self._launcher = None

    def stamp(self, slot: int, first: bool = False, stream=None) -> None:
        """Store the timer into ``slot`` of this call's row on ``stream`` (default: the current
        one); ``first``: the call's first stamp (advances the call counter)."""
        import torch
        from .primitives import LaunchCache
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")
        if stream is None:
            stream = torch.cuda.current_stream(self.table.device)
        if self._launcher is None:
            self._launcher = LaunchCache(compiled_stamp())
        self._launcher((self.table.data_ptr(), self.counter.data_ptr(), self.rows, self.slots,
                        int(slot), int(bool(first))), stream.cuda_stream)

    @staticmethod
    def warmup(device) -> None:
        """Compile, load and run the kernel once on a scratch table (so that no later call
        loads its module while another kernel spins)."""
        import torch
        DeviceStamps(1, 1, device).stamp(0, first=True)
        torch.cuda.synchronize(device)

    def calls(self) -> int:
        """Calls stamped so far (reads the counter: synchronizes)."""
        return int(self.counter.item())

    def last_calls(self, n: int):
        """int64 [n, slots] on the CPU: the stamps of the last n calls, oldest first
        (synchronizes). ValueError when fewer than n calls were stamped or n > rows (their rows
        were overwritten)."""
        done = self.calls()
        if not 1 <= n <= min(done, self.rows):
            raise ValueError(f"last {n} calls asked; {done} stamped, {self.rows} rows kept")
        idx = [(done - n + i) % self.rows for i in range(n)]
        return self.table.cpu()[idx]
