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
