"""A small PTX interpreter for the SIMT kernels of the planner (integer ops, predicates,
shuffles, CTA barriers, global / shared / param memory): runs the PTX the CuTe DSL compiles for
sm_90a on the host, so a compile-only machine can execute a kernel's exact instructions on
given inputs (tests/test_plan_kernel_emulated.py).

Scope: the instruction forms those kernels use (an unknown one raises NotImplementedError, so a
kernel change that needs more fails loudly, never silently). Every thread runs until it reaches
a shuffle or a barrier; a warp's shuffle is resolved when all its lanes stand at it (the kernels
shuffle with a full mask in warp-uniform code), a barrier when every thread of the CTA stands at
it. CTAs run one after the other (no inter-CTA communication in these kernels): the order of
two CTAs' stores to one word is the launch order here, any order on a GPU, so a result that
depends on it is a race the caller must look for separately (``Emulator.writers``). Threads of
a CTA run one after the other between barriers, so a missing barrier (a shared-memory race) is
not found here either.
"""
from __future__ import annotations

import re

M32, M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def _s(v, bits):
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _bits(t):
    return int(t[1:]) if t[1:].isdigit() else 32


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

        while i < n:
            c = body[i]
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


class Emulator:
    """Runs one kernel of `ptx`. Global memory: a flat bytearray (addresses are offsets into
    it); ``writers`` maps each global word address written to the set of CTAs that wrote it."""

    def __init__(self, ptx: str, global_bytes: int, shared_bytes: int = 1 << 16,
                 name: str | None = None):
        self.k = _Kernel(ptx, name)
        self.mem = bytearray(global_bytes)
        self.shared_bytes = shared_bytes
        self.writers: dict[int, set] = {}
        self.executed = 0

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
        special = {"%tid.x": "tid", "%ctaid.x": "cta", "%nctaid.x": "grid", "%ntid.x": "block"}
        if a in special:
            key = special[a]
            return lambda t, r: t[key]
        if a in ("%tid.y", "%tid.z", "%ctaid.y", "%ctaid.z"):
            return lambda t, r: 0
        if a == "__dynamic_shmem__0":
            return lambda t, r: 0
        if re.fullmatch(r"-?\d+", a):
            c = int(a) & m
            return lambda t, r: c
        if re.fullmatch(r"-?0[xX][0-9a-fA-F]+", a):
            c = int(a, 16) & m
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
            return lambda t, r, sh: _BAR
        if name == "shfl":
            return lambda t, r, sh: _SHFL
        d = args[0] if args else None
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
        if name == "not":
            a = O(args[1])

            def f(t, r, sh):
                r[d] = ~a(t, r) & m
                return nxt
            return f
        if name == "mul" or name == "mad":
            wide = base[1] == "wide"
            if base[1] not in ("wide", "lo") or (wide and name == "mad"):
                raise NotImplementedError(op)
            a, b = O(args[1]), O(args[2])
            c = O(args[3]) if name == "mad" else (lambda t, r: 0)
            sg = (lambda v: _s(v, bits)) if signed else (lambda v: v)
            mm = (1 << (2 * bits)) - 1 if wide else m

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
            cmp_, ct = base[1], base[2]
            if len(args) != 3 or "|" in d:
                raise NotImplementedError(f"setp form {op} {args}")
            cb = _bits(ct)
            a, b = O(args[1], cb), O(args[2], cb)
            sg = (lambda v: _s(v, cb)) if ct.startswith("s") else (lambda v: v)
            fn = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y,
                  "lt": lambda x, y: x < y, "le": lambda x, y: x <= y,
                  "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}[cmp_]

            def f(t, r, sh):
                r[d] = fn(sg(a(t, r)), sg(b(t, r)))
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
        if name in ("ld", "st"):
            space, nb = base[1], bits // 8
            mem = self.mem
            if name == "ld":
                kind, addr = self._address(args[1])
                if space == "param":
                    c = self.param[addr] & m

                    def f(t, r, sh):
                        r[d] = c
                        return nxt
                    return f
                if space == "global":
                    def f(t, r, sh):
                        x = addr(t, r) & M64
                        if x + nb > len(mem):
                            raise IndexError(f"global load at {x:#x} outside memory")
                        r[d] = int.from_bytes(mem[x:x + nb], "little")
                        return nxt
                    return f
                if space == "shared":
                    def f(t, r, sh):
                        x = addr(t, r) & M32
                        r[d] = int.from_bytes(sh[x:x + nb], "little")
                        return nxt
                    return f
                raise NotImplementedError(op)
            kind, addr = self._address(args[0])
            v = O(args[1])
            if space == "global":
                writers = self.writers

                def f(t, r, sh):
                    x = addr(t, r) & M64
                    if x + nb > len(mem):
                        raise IndexError(f"global store at {x:#x} outside memory")
                    mem[x:x + nb] = (v(t, r) & m).to_bytes(nb, "little")
                    for w in range(x - x % 4, x + nb, 4):
                        writers.setdefault(w, set()).add(t["cta"])
                    return nxt
                return f
            if space == "shared":
                def f(t, r, sh):
                    x = addr(t, r) & M32
                    if x + nb > len(sh):
                        raise IndexError(f"shared store at {x:#x} outside the shared memory")
                    sh[x:x + nb] = (v(t, r) & m).to_bytes(nb, "little")
                    return nxt
                return f
            raise NotImplementedError(op)
        raise NotImplementedError(f"PTX op {op}")

    # ---- execution ------------------------------------------------------------------------
    def launch(self, grid, block, params):
        """Run the kernel over `grid` CTAs of `block` threads (x only), `params` in the entry's
        order (ints)."""
        self.param = {nm: int(v) for (_, nm), v in zip(self.k.params, params)}
        self._code = [self._compile(i, s) for i, s in enumerate(self.k.stmts)]
        self._args = [None] * len(self.k.stmts)
        for i, s in enumerate(self.k.stmts):
            if s.startswith("shfl"):
                self._args[i] = self._shfl_args(s)
        for cta in range(grid):
            self._run_cta(cta, grid, block)

    def _shfl_args(self, s):
        op, rest = s.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        dst, dp = (args[0].split("|") + [None])[:2]
        return (op.split(".")[2], dst, dp, self._operand(args[1], 32),
                self._operand(args[2], 32), self._operand(args[3], 32))

    def _run_cta(self, cta, grid, block):
        shared = bytearray(self.shared_bytes)
        threads = [dict(tid=i, cta=cta, grid=grid, block=block, pc=0, regs={}, state=0)
                   for i in range(block)]
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
                for t in live:
                    t["pc"] += 1
                    t["state"] = 0
                continue
            raise RuntimeError(f"CTA {cta}: deadlock, thread states "
                               f"{sorted({t['state'] for t in live})}")

    def _shfl(self, lanes):
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
