"""A small PTX interpreter for SIMT kernels (integer ops, dp4a, predicates, shuffles, ballots and
match.any, warp and CTA barriers and barrier reductions, global / shared / param memory with
scalar and .v2 / .v4 accesses, red / atom add, min, max and cas on global and shared memory,
fences, %globaltimer, grids of x and y): runs the PTX the CuTe DSL compiles for sm_90a on the
host, so a compile-only machine can execute a kernel's exact instructions on
given inputs (tests/test_plan_kernel_emulated.py: the planner; tests/
test_dispatch_overlap_emulated.py: the dispatch's send, wait and expand kernels of several
emulated ranks in one memory; tests/test_ordered_routes_emulated.py: the ordered scale's table
kernels and prepare's routes kernels).

Scope: the instruction forms those kernels use (an unknown one raises NotImplementedError, so a
kernel change that needs more fails loudly, never silently). Every thread runs until it reaches
a shuffle, a ballot or a barrier; a warp's shuffle or ballot is resolved when all its lanes
stand at it (the kernels use a full mask in warp-uniform code), a barrier when every thread of
the CTA stands at it. CTAs run one after the other: the order of two CTAs' stores to one word is
the launch order here, any order on a GPU, so a result that depends on it is a race the caller
must look for separately (``Emulator.writers``). Threads of a CTA run one after the other
between barriers, so a missing barrier (a shared-memory race) is not found here either.

A sequential model: memory-order and scope qualifiers (.relaxed / .acquire / .release, .gpu /
.sys), cache operators (.cg) and fences (fence.acq_rel / fence.sc) change nothing here, and a
kernel that waits on another CTA or kernel only sees what ran before it (a wait whose condition
is not met spins on %globaltimer, a counter advancing per read, until its bound). What it cannot
see: real concurrency (interleavings, a CTA waiting for one launched after it) and memory
ordering (a missing fence or release, a stale L1 line); those stay for the GPU runs and the
PTX order checks (e.g. tests/test_dispatch_overlap_compile.py). Global and shared accesses must
be aligned to their size, as on the GPU.
"""
from __future__ import annotations

import bisect
import math
import re
import struct
from fractions import Fraction

M32, M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def _s(v, bits):
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _bits(t):
    return int(t[1:]) if t[1:].isdigit() else 32


def _f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits & M32))[0]


def _f32_bits_rn(x: Fraction) -> int:
    """The bits of the fp32 nearest to the exact value x (ties to even; overflow to inf)."""
    if x == 0:
        return 0
    sign = 0x80000000 if x < 0 else 0
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    e = max(e, -126)  # subnormals: the quantum of the smallest exponent
    q = x / Fraction(2) ** (e - 23)  # the significand in units of the last place
    n = q.numerator // q.denominator
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n & 1):
        n += 1
    if n >= 1 << 24:  # carried into the next binade
        n >>= 1
        e += 1
    if e > 127:
        return sign | 0x7F800000
    if n < 1 << 23:  # subnormal
        return sign | n
    return sign | (e + 127) << 23 | (n - (1 << 23))


def _fma_f32(a, b, c):
    """fma.rn.f32 on bit patterns: a * b + c rounded once."""
    fa, fb, fc = _f32(a), _f32(b), _f32(c)
    if not all(math.isfinite(v) for v in (fa, fb, fc)):
        v = fa * fb + fc  # inf / NaN propagation (the exact path needs finite operands)
        return struct.unpack("<I", struct.pack("<f", v))[0] if not math.isnan(v) else 0x7FFFFFFF
    v = Fraction(fa) * Fraction(fb) + Fraction(fc)
    if v == 0:  # an exact zero is -0 only as -0 + -0 (round to nearest), else +0
        p_neg = math.copysign(1, fa) * math.copysign(1, fb) < 0
        both = fa * fb == 0 and fc == 0 and p_neg and math.copysign(1, fc) < 0
        return 0x80000000 if both else 0
    return _f32_bits_rn(v)


def _bf16_rn(bits):
    """cvt.rn.bf16.f32 on a bit pattern: the upper 16 bits rounded to nearest even."""
    bits &= M32
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return 0x7FFF  # a NaN: the canonical one
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


SHARED_POISON = 0xA7  # the byte every CTA's shared memory starts as

class _Kernel:
    """One .entry: its parameters and its statements (scoped .reg names made unique)."""

    def __init__(self, ptx: str, name: str | None = None):
        ptx = re.sub(r"//[^\n]*", "", ptx)
        entries = list(re.finditer(r"\.entry\s+(\w+)\s*\(", ptx))
        if not entries:
            raise ValueError("no .entry in the PTX")
        m = entries[0] if name is None else next(e for e in entries if e.group(1) == name)
        self.name = m.group(1)
        close = ptx.index(")", m.end())
        self.params = re.findall(r"\.param\s+\.(\w+)\s+(\w+)", ptx[m.end():close])
        body = ptx[ptx.index("{", close):]
        self.stmts, self.labels = [], {}
        self._parse(body)

    def _parse(self, body):
        scopes, uid = [], [0]
        i, n, cur = 0, len(body), []
        rename_stack = [{}]

        def flush():
            s = "".join(cur).strip()
            cur.clear()
            if not s:
                return
            while True:
                lm = re.match(r"(\$?[\w$]+):\s*", s)
                if not lm:
                    break
                self.labels[lm.group(1)] = len(self.stmts)
                s = s[lm.end():]
            if not s:
                return
            if s.startswith(".reg"):
                names = [x.strip() for x in re.match(r"\.reg\s+\.\w+\s+(.*)", s).group(1)
                         .split(",")]
                if len(scopes) > 1:  # an inline-asm block's own registers: unique names
                    for nm in names:
                        uid[0] += 1
                        rename_stack[-1][nm] = f"{nm}#{uid[0]}"
                return
            if s.startswith("."):
                return
            ren = {}
            for d in rename_stack:
                ren.update(d)
            if ren:
                s = re.sub(r"(?<![\w%$#.])([A-Za-z_]\w*)(?![\w#])",
                           lambda mm: ren.get(mm.group(1), mm.group(1)), s)
            self.stmts.append(s)

        def in_statement():
            """A statement has begun (its braces are a vector operand, not an inline-asm scope);
            labels before it do not count."""
            return re.sub(r"^\s*(\$?[\w$]+:\s*)*", "", "".join(cur)).strip() != ""

        while i < n:
            c = body[i]
            if c == "{" and in_statement():
                close = body.index("}", i)
                cur.append(body[i:close + 1].replace(",", "|"))  # one operand: a|b|c|d
                i = close + 1
                continue
            if c == "{":
                flush()
                scopes.append(i)
                rename_stack.append({})
            elif c == "}":
                flush()
                scopes.pop()
                rename_stack.pop()
                if not scopes:
                    break
            elif c == ";":
                flush()
            else:
                cur.append(c)
            i += 1


# qualifiers of ld / st / red / atom that change nothing in a sequential model (memory-order
# semantics and scopes, cache operators); any other qualifier is refused
_ORDER_QUALS = {"weak", "relaxed", "acquire", "release", "acq_rel", "cta", "gpu", "sys",
                "ca", "cg", "cs", "wb"}


class Emulator:
    """Runs one kernel of `ptx`. Global memory: a flat bytearray (addresses are offsets into
    it; ``mem`` shares one between several emulators, e.g. one per rank and kernel, so peer
    pointers are plain offsets); ``writers`` maps each global word address written to the set
    of CTAs that wrote it. ``%globaltimer`` reads a counter that advances ``timer_step_ns`` per
    read (a bounded wait times out after timeout / step reads)."""

    def __init__(self, ptx: str, global_bytes: int = 0, shared_bytes: int = 1 << 16,
                 name: str | None = None, mem: bytearray | None = None,
                 timer_step_ns: int = 1000, load_hooks: dict | None = None,
                 log_stores: tuple[int, int] | None = None,
                 valid: list[tuple[int, int]] | None = None):
        self.k = _Kernel(ptx, name)
        self.mem = bytearray(global_bytes) if mem is None else mem
        self.shared_bytes = shared_bytes
        self.writers: dict[int, set] = {}
        # load_hooks {global address: fn(emulator)}: fn runs before every global load of that
        # address (e.g. another emulated rank's kernel delivering what a wait polls for: an
        # arrival between two items of one CTA); log_stores (lo, hi): every global store /
        # atomic to [lo, hi) appended to ``stores`` as (address, value, CTA), in order
        self.load_hooks = dict(load_hooks or {})
        # valid [(lo, hi)]: the allocated global ranges; any global load, store or atomic not
        # wholly inside one of them raises (as on the GPU, where address 0 or a gap faults),
        # not only the stores the callers' write logs check. None: the whole bytearray.
        self.valid = None if valid is None else sorted((int(a), int(b)) for a, b in valid)
        self._valid_lo = None if valid is None else [a for a, _ in self.valid]
        self.log_stores, self.stores = log_stores, []
        self.executed = 0
        self.clock, self.timer_step_ns = 0, int(timer_step_ns)

    # ---- memory helpers for the caller --------------------------------------------------
    def write_words(self, addr, values, bits=32):
        nb = bits // 8
        for j, v in enumerate(values):
            self.mem[addr + nb * j:addr + nb * (j + 1)] = (int(v) & ((1 << bits) - 1)).to_bytes(
                nb, "little")

    def read_words(self, addr, count, bits=32):
        nb = bits // 8
        return [_s(int.from_bytes(self.mem[addr + nb * j:addr + nb * (j + 1)], "little"), bits)
                for j in range(count)]

    # ---- compilation: one closure per statement -------------------------------------------
    # A closure takes (thread, regs, shared) and returns the next pc, or a stop code:
    # _BAR / _SHFL (the thread waits there) or _DONE.
    def _operand(self, a, bits):
        """A reader (thread, regs) -> value of operand `a` as an unsigned `bits`-bit word."""
        m = (1 << bits) - 1
        special = {"%tid.x": "tid", "%ctaid.x": "cta", "%nctaid.x": "grid", "%ntid.x": "block",
                   "%ctaid.y": "cta_y", "%nctaid.y": "grid_y"}
        if a in special:
            key = special[a]
            return lambda t, r: t[key]
        if a in ("%tid.y", "%tid.z", "%ctaid.z"):
            return lambda t, r: 0
        if a in ("%ntid.y", "%ntid.z", "%nctaid.z"):
            return lambda t, r: 1
        if a == "__dynamic_shmem__0":
            return lambda t, r: 0
        if a == "%globaltimer":
            def timer(t, r):
                self.clock += self.timer_step_ns
                return self.clock & m
            return timer
        if re.fullmatch(r"-?\d+", a):
            c = int(a) & m
            return lambda t, r: c
        if re.fullmatch(r"-?0[xX][0-9a-fA-F]+", a):
            c = int(a, 16) & m
            return lambda t, r: c
        if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", a) and bits == 32:  # an f32 constant's bits
            c = int(a[2:], 16)
            return lambda t, r: c
        if a in self.param:
            c = self.param[a] & m
            return lambda t, r: c
        if a.startswith("%") or "#" in a or re.fullmatch(r"[A-Za-z_]\w*", a):
            def reg(t, r, a=a):
                try:
                    return r[a]
                except KeyError:
                    raise KeyError(f"read of unset register {a} at pc {t['pc']}") from None
            return reg
        raise NotImplementedError(f"operand {a}")

    def _address(self, a):
        inner = a.strip()[1:-1].strip()
        m = re.fullmatch(r"([^+]+?)\s*\+\s*(-?\d+)", inner)
        off = 0
        if m:
            inner, off = m.group(1).strip(), int(m.group(2))
        if inner in self.param:
            return ("param", inner)
        rd = self._operand(inner, 64)
        return ("reg", lambda t, r: rd(t, r) + off)

    def _compile(self, pc, s):
        nxt = pc + 1
        pred = None
        pm = re.match(r"@(!?)([%\w#]+)\s+", s)
        if pm:
            pred = (pm.group(1) == "!", pm.group(2))
            s = s[pm.end():]
        parts = s.split(None, 1)
        op = parts[0]
        args = [a.strip() for a in parts[1].split(",")] if len(parts) > 1 else []
        f = self._compile_op(op, args, nxt)
        if pred is None:
            return f
        neg, pr = pred

        def guarded(t, r, sh):
            if r[pr] == neg:
                return nxt
            return f(t, r, sh)
        return guarded

    def _compile_op(self, op, args, nxt):
        base = op.split(".")
        name, typ = base[0], base[-1]
        bits = _bits(typ) if typ[0] in "sub" and typ[1:].isdigit() else 32
        signed = typ.startswith("s") and typ[1:].isdigit()
        m = (1 << bits) - 1
        O = lambda a, b=bits: self._operand(a, b)  # noqa: E731
        if name == "bra":
            target = self.k.labels[args[0]]
            return lambda t, r, sh: target
        if name in ("ret", "exit"):
            return lambda t, r, sh: _DONE
        if name == "bar":
            if op == "bar.warp.sync":
                if args[0] not in ("-1", "0xffffffff", "0xFFFFFFFF"):
                    raise NotImplementedError(f"bar.warp.sync {args} (full mask only)")
                return lambda t, r, sh: _SHFL  # every lane of the warp stands here, then goes on
            if base[1] == "red" and base[2] in ("or", "and") and typ == "pred":
                return lambda t, r, sh: _BAR  # the reduction is done at the release
            if op != "bar.sync" or len(args) != 1:
                raise NotImplementedError(f"barrier form {op} {args}")
            return lambda t, r, sh: _BAR
        if name == "shfl":
            return lambda t, r, sh: _SHFL
        if name == "vote":
            if op != "vote.sync.ballot.b32" or args[2] not in ("-1", "0xffffffff", "0xFFFFFFFF"):
                raise NotImplementedError(f"vote form {op} {args} (full-mask ballot only)")
            return lambda t, r, sh: _SHFL  # a warp collective, resolved as the shuffles
        if name == "match":
            if op != "match.any.sync.b32" or args[2] not in ("-1", "0xffffffff", "0xFFFFFFFF"):
                raise NotImplementedError(f"match form {op} {args} (full-mask any.b32 only)")
            return lambda t, r, sh: _SHFL  # a warp collective, resolved as the shuffles
        if name == "fence":
            # memory ordering is invisible in a sequential model: the proxy / mbarrier fences
            # concern machinery it does not model, so they are refused
            if base[1] not in ("acq_rel", "sc") or len(base) != 3:
                raise NotImplementedError(f"fence form {op}")
            return lambda t, r, sh: nxt
        d = args[0] if args else None
        if op == "fma.rn.f32":
            a, b, c = O(args[1]), O(args[2]), O(args[3])

            def f(t, r, sh):
                r[d] = _fma_f32(a(t, r), b(t, r), c(t, r))
                return nxt
            return f
        if name == "dp4a":  # d = c + sum of the 4 byte products of a and b (each byte u8 / s8)
            if len(base) != 3 or base[1] not in ("u32", "s32") or base[2] not in ("u32", "s32"):
                raise NotImplementedError(op)
            a, b, c = O(args[1], 32), O(args[2], 32), O(args[3], 32)
            sa, sb = base[1] == "s32", base[2] == "s32"

            def byte(v, j, sgn):
                x = (v >> (8 * j)) & 0xFF
                return x - 256 if sgn and x >= 128 else x

            def f(t, r, sh):
                x, y = a(t, r), b(t, r)
                r[d] = (c(t, r) + sum(byte(x, j, sa) * byte(y, j, sb) for j in range(4))) & M32
                return nxt
            return f
        if op == "cvt.rn.bf16x2.f32":  # d = {bf16(a) high, bf16(b) low}
            a, b = O(args[1]), O(args[2])

            def f(t, r, sh):
                r[d] = _bf16_rn(a(t, r)) << 16 | _bf16_rn(b(t, r))
                return nxt
            return f
        if typ[0] == "f" and name not in ("mov", "selp", "ld", "st"):
            # only the float forms above are modelled: an integer reading of another would be
            # silently wrong
            raise NotImplementedError(f"float op {op}")
        if name == "mov":
            if typ == "pred":
                v = args[1]
                if v.lstrip("-").isdigit():
                    c = v != "0"

                    def f(t, r, sh):
                        r[d] = c
                        return nxt
                    return f
                def f(t, r, sh):  # noqa: E306
                    r[d] = r[v]
                    return nxt
                return f
            if d.startswith("{") or args[1].startswith("{"):  # unpack / pack: low part first
                if typ not in ("b64", "b32") or d.startswith("{") == args[1].startswith("{"):
                    raise NotImplementedError(f"mov form {op} {args}")
                vec = (d if d.startswith("{") else args[1]).strip("{}").split("|")
                parts = [x.strip() for x in vec]
                pb = bits // len(parts)
                if d.startswith("{"):
                    a = O(args[1])

                    def f(t, r, sh):
                        v = a(t, r)
                        for j, x in enumerate(parts):
                            if x != "_":  # the sink: that part is dropped
                                r[x] = (v >> (pb * j)) & ((1 << pb) - 1)
                        return nxt
                    return f
                srcs = [O(x, pb) for x in parts]

                def f(t, r, sh):
                    r[d] = sum(g(t, r) << (pb * j) for j, g in enumerate(srcs)) & m
                    return nxt
                return f
            a = O(args[1])

            def f(t, r, sh):
                r[d] = a(t, r) & m
                return nxt
            return f
        if typ == "pred" and name in ("and", "or", "xor", "not"):
            x = args[1]
            y = args[2] if len(args) > 2 else None
            fn = {"and": lambda p, q: p and q, "or": lambda p, q: p or q,
                  "xor": lambda p, q: p != q, "not": lambda p, q: not p}[name]

            def f(t, r, sh):
                r[d] = fn(r[x], r[y] if y else None)
                return nxt
            return f
        if name in ("add", "sub", "min", "max", "div", "rem", "and", "or", "xor"):
            a, b = O(args[1]), O(args[2])
            sg = (lambda v: _s(v, bits)) if signed else (lambda v: v)

            def tdiv(x, y):
                return abs(x) // abs(y) * (1 if (x >= 0) == (y >= 0) else -1)
            fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "min": min, "max": max,
                  "div": lambda x, y: tdiv(x, y) if y else m,
                  "rem": lambda x, y: x - tdiv(x, y) * y if y else x,
                  "and": lambda x, y: x & y, "or": lambda x, y: x | y,
                  "xor": lambda x, y: x ^ y}[name]

            def f(t, r, sh):
                r[d] = fn(sg(a(t, r)), sg(b(t, r))) & m
                return nxt
            return f
        if name == "popc":
            a = O(args[1])

            def f(t, r, sh):
                r[d] = bin(a(t, r)).count("1")
                return nxt
            return f
        if name == "neg":
            a = O(args[1])

            def f(t, r, sh):
                r[d] = -a(t, r) & m
                return nxt
            return f
        if name == "not":
            a = O(args[1])

            def f(t, r, sh):
                r[d] = ~a(t, r) & m
                return nxt
            return f
        if name == "mul" or name == "mad":
            wide = base[1] == "wide"
            if base[1] not in ("wide", "lo", "hi") or (base[1] != "lo" and name == "mad"):
                raise NotImplementedError(op)
            a, b = O(args[1]), O(args[2])
            c = O(args[3]) if name == "mad" else (lambda t, r: 0)
            sg = (lambda v: _s(v, bits)) if signed else (lambda v: v)
            mm = (1 << (2 * bits)) - 1 if wide else m
            if base[1] == "hi":  # the high half of the 2 x bits product (division by constants)
                def f(t, r, sh):
                    r[d] = (sg(a(t, r)) * sg(b(t, r)) >> bits) & m
                    return nxt
                return f

            def f(t, r, sh):
                r[d] = (sg(a(t, r)) * sg(b(t, r)) + sg(c(t, r))) & mm
                return nxt
            return f
        if name in ("shl", "shr"):
            a, b = O(args[1]), O(args[2], 32)
            if name == "shl":
                def f(t, r, sh):
                    n = b(t, r)
                    r[d] = (a(t, r) << n) & m if n < bits else 0
                    return nxt
            elif signed:
                def f(t, r, sh):
                    r[d] = (_s(a(t, r), bits) >> min(b(t, r), bits - 1)) & m
                    return nxt
            else:
                def f(t, r, sh):
                    n = b(t, r)
                    r[d] = a(t, r) >> n if n < bits else 0
                    return nxt
            return f
        if name == "setp":
            cmp_, ct = base[1], base[-1]
            combine = base[2] if len(base) == 4 else None
            if "|" in d or len(base) not in (3, 4) or len(args) != (3 if combine is None else 4) \
                    or combine not in (None, "and", "or", "xor"):
                raise NotImplementedError(f"setp form {op} {args}")
            cb = _bits(ct)
            a, b = O(args[1], cb), O(args[2], cb)
            sg = (lambda v: _s(v, cb)) if ct.startswith("s") else (lambda v: v)
            fn = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y,
                  "lt": lambda x, y: x < y, "le": lambda x, y: x <= y,
                  "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}[cmp_]

            if combine is None:
                def f(t, r, sh):
                    r[d] = fn(sg(a(t, r)), sg(b(t, r)))
                    return nxt
                return f
            cneg, cp = args[3].startswith("!"), args[3].lstrip("!")
            bfn = {"and": lambda x, y: x and y, "or": lambda x, y: x or y,
                   "xor": lambda x, y: x != y}[combine]

            def f(t, r, sh):
                r[d] = bfn(fn(sg(a(t, r)), sg(b(t, r))), r[cp] != cneg)
                return nxt
            return f
        if name == "selp":
            a, b, p = O(args[1]), O(args[2]), args[3]

            def f(t, r, sh):
                r[d] = (a(t, r) if r[p] else b(t, r)) & m
                return nxt
            return f
        if name == "cvt":
            dt, st_ = base[1], base[2]
            sb, db = _bits(st_), _bits(dt)
            a = O(args[1], sb)
            sg = (lambda v: _s(v, sb)) if st_.startswith("s") else (lambda v: v)
            dm = (1 << db) - 1

            def f(t, r, sh):
                r[d] = sg(a(t, r)) & dm
                return nxt
            return f
        if name in ("ld", "st", "red", "atom"):
            return self._compile_memory(op, base, args, nxt)
        raise NotImplementedError(f"PTX op {op}")

    def _compile_memory(self, op, base, args, nxt):
        """ld / st (scalar or .v2 / .v4; global, shared, param) and red / atom (add, min, max,
        cas; min / max signed for .s types) on global and shared memory. Order and scope
        qualifiers and cache operators are accepted and mean nothing here (one thread at a
        time); global and shared accesses must be aligned to their size, as on the GPU."""
        name, typ = base[0], base[-1]
        quals = base[1:-1]
        spaces = [q for q in quals if q in ("global", "shared", "param")]
        vec = [q for q in quals if q in ("v2", "v4")]
        rop = [q for q in quals if q in ("add", "cas", "min", "max")]
        rest = [q for q in quals if q not in _ORDER_QUALS and q not in spaces + vec + rop]
        atomic = name in ("red", "atom")
        if (len(spaces) != 1 or rest or len(vec) > 1 or len(rop) != atomic
                or (atomic and (vec or spaces[0] == "param" or (name, rop[0]) == ("red", "cas")))
                or typ[0] not in "subf" or not typ[1:].isdigit()
                or (typ[0] == "f" and atomic)):
            raise NotImplementedError(f"memory op {op}")
        space, bits = spaces[0], _bits(typ)
        nb, m = bits // 8, (1 << bits) - 1
        nv = int(vec[0][1:]) if vec else 1
        width = nb * nv
        mem, writers = self.mem, self.writers

        def regs_of(a):
            out = [x.strip() for x in a.strip("{}").split("|")] if a.startswith("{") else [a]
            if len(out) != nv:
                raise NotImplementedError(f"{op}: {len(out)} operands for .v{nv}")
            return out

        strict = self.valid is not None and space == "global"

        def at(x, size, what, limit):
            if x % size:
                raise RuntimeError(f"misaligned {space} {what} at {x:#x} ({size} bytes)")
            if x + size > limit:
                raise IndexError(f"{space} {what} at {x:#x} outside the {space} memory")
            if strict:
                i = bisect.bisect_right(self._valid_lo, x) - 1
                if i < 0 or x + size > self.valid[i][1]:
                    raise IndexError(f"global {what} at {x:#x} ({size} bytes) outside every "
                                     "allocation (an illegal address on the GPU)")

        log = self.log_stores

        def wrote(t, x, size, value=None):
            for w in range(x - x % 4, x + size, 4):
                writers.setdefault(w, set()).add(t.get("who", t["cta"]))
            if log is not None and log[0] <= x < log[1]:
                self.stores.append((x, value, t.get("who", t["cta"])))

        if atomic:
            dst = args[0] if name == "atom" else None
            kind, addr = self._address(args[1 if dst else 0])
            ops = [self._operand(a, bits) for a in args[(2 if dst else 1):]]
            if len(ops) != (2 if rop[0] == "cas" else 1):
                raise NotImplementedError(f"{op} {args}")

            glob = space == "global"
            sg = (lambda v: _s(v, bits)) if typ[0] == "s" else (lambda v: v)

            def f(t, r, sh):
                x = addr(t, r) & (M64 if glob else M32)
                dst_mem = mem if glob else sh
                at(x, nb, name, len(dst_mem))
                old = int.from_bytes(dst_mem[x:x + nb], "little")
                if rop[0] == "add":
                    new = (old + ops[0](t, r)) & m
                elif rop[0] == "cas":
                    new = ops[1](t, r) if old == ops[0](t, r) else old
                else:
                    new = (min if rop[0] == "min" else max)(sg(old), sg(ops[0](t, r))) & m
                dst_mem[x:x + nb] = new.to_bytes(nb, "little")
                if glob:
                    wrote(t, x, nb, _s(new, bits))
                if dst:
                    r[dst] = old
                return nxt
            return f
        if name == "ld":
            dsts = regs_of(args[0])
            kind, addr = self._address(args[1])
            if space == "param":
                if nv != 1 or kind != "param":
                    raise NotImplementedError(f"{op} {args}")
                c = self.param[addr] & m

                def f(t, r, sh):
                    r[dsts[0]] = c
                    return nxt
                return f
            glob = space == "global"
            hooks = self.load_hooks if glob else {}

            def f(t, r, sh):
                x = addr(t, r) & (M64 if glob else M32)
                if hooks and x in hooks:
                    hooks[x](self)
                src = mem if glob else sh
                at(x, width, "load", len(src))
                for j, dd in enumerate(dsts):
                    r[dd] = int.from_bytes(src[x + nb * j:x + nb * (j + 1)], "little")
                return nxt
            return f
        if space == "param":
            raise NotImplementedError(op)
        kind, addr = self._address(args[0])
        vals = [self._operand(a, bits) for a in regs_of(args[1])]
        glob = space == "global"

        def f(t, r, sh):
            x = addr(t, r) & (M64 if glob else M32)
            dst_mem = mem if glob else sh
            at(x, width, "store", len(dst_mem))
            vs = [v(t, r) & m for v in vals]
            for j, v in enumerate(vs):
                dst_mem[x + nb * j:x + nb * (j + 1)] = v.to_bytes(nb, "little")
            if glob:
                wrote(t, x, width, _s(vs[0], bits) if nv == 1 else None)
            return nxt
        return f

    # ---- execution ------------------------------------------------------------------------
    def launch(self, grid, block, params):
        """Run the kernel over `grid` CTAs (an int: x only; (x, y): y outer, CTA (x, y) in
        ``writers`` as that pair) of `block` threads (x only), `params` in the entry's order
        (ints)."""
        gx, gy = (grid, 1) if isinstance(grid, int) else (int(grid[0]), int(grid[1]))
        self.param = {nm: int(v) for (_, nm), v in zip(self.k.params, params)}
        self._code = [self._compile(i, s) for i, s in enumerate(self.k.stmts)]
        self._args = [None] * len(self.k.stmts)
        for i, s in enumerate(self.k.stmts):
            if s.startswith("shfl"):
                self._args[i] = self._shfl_args(s)
            elif s.startswith("vote"):  # vote.sync.ballot.b32 d, p, -1 (checked when compiled)
                d, p = [a.strip() for a in s.split(None, 1)[1].split(",")][:2]
                self._args[i] = ("ballot", d, p)
            elif s.startswith("match"):  # match.any.sync.b32 d, a, -1 (checked when compiled)
                d, a = [x.strip() for x in s.split(None, 1)[1].split(",")][:2]
                self._args[i] = ("match", d, self._operand(a, 32))
            elif s.startswith("bar.warp.sync"):
                self._args[i] = ("warp_sync",)
            elif s.startswith("bar.red"):  # bar.red.{or,and}.pred d, 0, p
                op, rest = s.split(None, 1)
                d, bar_id, p = [a.strip() for a in rest.split(",")]
                if bar_id != "0":
                    raise NotImplementedError(f"barrier {bar_id}: {s}")
                self._args[i] = (op.split(".")[2], d, p)
        for y in range(gy):
            for x in range(gx):
                self._run_cta(x, gx, block, y, gy, isinstance(grid, int))

    def _shfl_args(self, s):
        op, rest = s.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        dst, dp = (args[0].split("|") + [None])[:2]
        return (op.split(".")[2], dst, dp, self._operand(args[1], 32),
                self._operand(args[2], 32), self._operand(args[3], 32))

    def _run_cta(self, cta, grid, block, cta_y=0, grid_y=1, x_only=True):
        # not zeroed: on the GPU a CTA's shared memory holds what the SM's last kernel left
        # there, so a kernel that reads a word it did not write must not pass by luck
        shared = bytearray([SHARED_POISON]) * self.shared_bytes
        threads = [dict(tid=i, cta=cta, grid=grid, block=block, pc=0, regs={}, state=0,
                        cta_y=cta_y, grid_y=grid_y) for i in range(block)]
        if not x_only:  # the CTA's writes recorded as (x, y)
            for t in threads:
                t["who"] = (cta, cta_y)
        while True:
            for t in threads:
                if t["state"] == 0:
                    self._run_thread(t, shared)
            live = [t for t in threads if t["state"] != _DONE]
            if not live:
                return
            progressed = False
            for w in range(0, block, 32):
                lanes = threads[w:w + 32]
                if all(t["state"] == _SHFL for t in lanes):
                    pcs = {t["pc"] for t in lanes}
                    if len(pcs) != 1:
                        raise RuntimeError(f"CTA {cta} warp {w // 32}: lanes at different "
                                           f"shuffles {sorted(pcs)}")
                    self._shfl(lanes)
                    progressed = True
            if progressed:
                continue
            if all(t["state"] == _BAR for t in live):
                if len(live) != block:
                    raise RuntimeError(f"CTA {cta}: barrier with exited threads")
                pcs = {t["pc"] for t in live}
                if len(pcs) != 1:
                    raise RuntimeError(f"CTA {cta}: threads at different barriers {sorted(pcs)}")
                red = self._args[live[0]["pc"]]
                if red is not None:  # bar.red: every thread gets the CTA's or / and
                    op, dst, p = red
                    neg, p = p.startswith("!"), p.lstrip("!")
                    vals = [t["regs"][p] != neg for t in live]
                    v = any(vals) if op == "or" else all(vals)
                    for t in live:
                        t["regs"][dst] = v
                for t in live:
                    t["pc"] += 1
                    t["state"] = 0
                continue
            raise RuntimeError(f"CTA {cta}: deadlock, thread states "
                               f"{sorted({t['state'] for t in live})}")

    def _shfl(self, lanes):
        kind = self._args[lanes[0]["pc"]][0]
        if kind in ("match", "warp_sync"):
            if kind == "match":  # each lane: the lanes whose value equals its own
                _, dst, a = self._args[lanes[0]["pc"]]
                vals = [a(t, t["regs"]) for t in lanes]
                masks = [sum(1 << j for j, v in enumerate(vals) if v == u) for u in vals]
            for li, t in enumerate(lanes):
                if kind == "match":
                    t["regs"][dst] = masks[li]
                t["pc"] += 1
                t["state"] = 0
            return
        if kind == "ballot":
            _, dst, p = self._args[lanes[0]["pc"]]
            neg, p = p.startswith("!"), p.lstrip("!")
            v = sum(1 << li for li, t in enumerate(lanes) if t["regs"][p] != neg)
            for t in lanes:
                t["regs"][dst] = v
                t["pc"] += 1
                t["state"] = 0
            return
        mode, dst, dp, a, b, c = self._args[lanes[0]["pc"]]
        vals = [a(t, t["regs"]) for t in lanes]
        res = []
        for li, t in enumerate(lanes):
            r = t["regs"]
            bv, cv = b(t, r) & 31, c(t, r)
            seg = (cv >> 8) & 31
            maxl = (li & seg) | (cv & 31 & ~seg)
            if mode == "up":
                j = li - bv
                p = j >= maxl
            elif mode == "down":
                j = li + bv
                p = j <= maxl
            elif mode == "bfly":
                j = li ^ bv
                p = j <= maxl
            elif mode == "idx":
                j = (li & seg) | (bv & ~seg)
                p = j <= maxl
            else:
                raise NotImplementedError(mode)
            res.append((vals[j if p else li], p))
        for t, (v, p) in zip(lanes, res):
            t["regs"][dst] = v
            if dp:
                t["regs"][dp] = p
            t["pc"] += 1
            t["state"] = 0

    def _run_thread(self, t, shared):
        regs, code = t["regs"], self._code
        pc = t["pc"]
        n = 0
        while True:
            if pc >= len(code):
                t["pc"], t["state"] = pc, _DONE
                break
            nxt = code[pc](t, regs, shared)
            n += 1
            if nxt < 0:
                t["pc"] = pc
                t["state"] = nxt
                break
            pc = nxt
            t["pc"] = pc
        self.executed += n


_BAR, _SHFL, _DONE = -1, -2, -3
