"""The launches of a compiled CuTe DSL launcher, read from the host code CuTe DSL generates, for
the host-emulated tests (tests/ptx_emulator.py): which launcher argument reaches which kernel
parameter, each launch's grid, block and dynamic shared bytes are the compiled ones, not
restated in a test."""
import re


def host_launches(ir: str, lowered: str) -> list:
    """Launches in order, each (kernel entry, operands, (grid x, grid y), block x, dynamic shared
    bytes), an operand / size being ("arg", i) for the launcher's i-th argument or ("const",
    value). ir: the host IR CuTe DSL prints (CUTE_DSL_PRINT_IR); lowered: str(compiled
    .ir_module)."""
    host = ir[ir.rindex("func.func @cutlass_"):]
    consts = {m.group(1): int(m.group(2))
              for m in re.finditer(r"(%c\w+) = arith\.constant (-?\d+) :", host)}

    def operand(v):
        v = v.strip()
        m = re.fullmatch(r"%arg(\d+)", v)
        return ("arg", int(m.group(1))) if m else ("const", consts[v])

    cfgs = {m.group(1): ((operand(m.group(3)), operand(m.group(4))), operand(m.group(2)))
            for m in re.finditer(r"(%\w+) = cuda\.launch_cfg\.create<[^>]*> \(blockDim = "
                                 r"\(([^,]+),[^)]*\), dynamicSmemBytes = [^,]+, gridDim = "
                                 r"\(([^,]+),([^,]+),", host)}
    launches = []
    for m in re.finditer(r"cuda\.launch_ex @kernels::@(\w+)<(%\w+)> \(([^)]*)\)", host):
        grid, block = cfgs[m.group(2)]
        launches.append((m.group(1), [operand(v) for v in m.group(3).split(",")], grid, block))
    smem = launch_smem(lowered)
    assert launches and len(smem) == len(launches), (smem, launches)
    return [x + (b,) for x, b in zip(launches, smem)]


def launch_smem(lowered: str) -> list:
    """Each launch's dynamic shared memory bytes (what CuTe DSL infers from the kernel's
    SmemAllocator), in launch order, from the lowered host code: the i64 field 2 of each launch
    config struct (array<3 x i32> grid, array<3 x i32> block, i64 smem, ...)."""
    consts = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i64\) : i64", lowered))
    lines = lowered.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"(%\w+) = llvm\.getelementptr %\w+\[0, 2\] : \(!llvm\.ptr\) -> "
                      r"!llvm\.ptr, !llvm\.struct<\(array<3 x i32>, array<3 x i32>, i64,", line)
        if m:
            st = next(re.search(rf"llvm\.store (%\w+), {m.group(1)} : i64", x)
                      for x in lines[i + 1:i + 4] if re.search(rf", {m.group(1)} : i64", x))
            out.append(int(consts[st.group(1)]))
    return out


class Device:
    """The emulated device memory of tests that call the library's real launch wrappers: every
    CPU storage whose address reaches a launch gets a Heap region (poisoned gaps between them,
    so a stray access raises); before each launch the host bytes are copied in (pointer tables,
    ``register(t, table=True)``, translated to the regions they point into), after it copied
    back, so the torch ops between launches act on the same data in stream order."""

    def __init__(self):
        from emulated_memory import Heap
        self.h = Heap()
        self.h.top = 0x100000
        self.mem = bytearray(0)
        self.storages = {}  # base -> (nbytes, heap address, uint8 view of the whole storage)
        self.tables = set()  # storage bases of pointer tables
        self.launches = []  # (entry, grid, block, smem) in launch order

    def register(self, t, table=False):
        import torch
        st = t.untyped_storage()
        base, n = st.data_ptr(), st.nbytes()
        if n == 0 or base in self.storages:
            return
        whole = torch.empty(0, dtype=torch.uint8).set_(st, 0, (n,), (1,))
        self.storages[base] = (n, self.h.alloc(("s", base), n), whole)
        if table:
            self.tables.add(base)
        need = self.h.top + 0x1000
        if len(self.mem) < need:
            self.mem.extend(bytes([0x5A]) * (need - len(self.mem)))

    def translate(self, v):
        for base, (n, addr, _) in self.storages.items():
            if base <= v < base + n:
                return addr + (v - base)
        return v

    def to_device(self):
        import torch
        for base, (n, addr, whole) in self.storages.items():
            if base in self.tables:
                vals = whole.view(torch.int64).tolist()
                data = b"".join((self.translate(v) if v else 0).to_bytes(8, "little", signed=True)
                                for v in vals)
            else:
                data = whole.numpy().tobytes()
            self.mem[addr:addr + n] = data

    def to_host(self):
        import torch
        for base, (n, addr, whole) in self.storages.items():
            if base not in self.tables:
                whole.copy_(torch.frombuffer(bytearray(self.mem[addr:addr + n]), dtype=torch.uint8))

    def run(self, ptx, entry, grid, block, params, smem):
        """One launch; shared memory exactly the launch's dynamic bytes (an access past them
        raises, as it faults on the GPU)."""
        from ptx_emulator import Emulator
        self.to_device()
        em = Emulator(ptx, mem=self.mem, name=entry, valid=self.h.ranges(), shared_bytes=smem)
        try:
            em.launch(grid, block, params)
        except Exception as e:
            e.add_note(f"in {entry}, grid {grid}, block {block}, {smem} shared bytes")
            raise
        self.to_host()
        self.launches.append((entry, grid, block, smem))
