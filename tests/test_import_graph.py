"""The package's imports form layers with no cycle: runtime < kernels < {combine, ffn} < cli,
combine and ffn never import each other, and no file imports one that imports it back (lazy imports
inside functions count). Read from the source with ast, so it needs neither CUDA nor CuTe DSL."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "moe_overlap"

# part of the package -> the parts it may import (besides itself)
ALLOWED = {
    "runtime": set(),
    "util": {"runtime"},  # routing, launch, timing, report, diagnostics, provenance, paths
    "kernels": {"runtime"},
    "combine": {"runtime", "kernels", "util"},
    "ffn": {"runtime", "kernels", "util"},
    "cli": {"combine", "ffn", "util", "runtime", "kernels"},
    "top": {"combine", "ffn", "util", "runtime", "kernels", "cli"},  # __init__, aliases, __main__
}
UTIL = {"routing", "launch", "timing", "report", "diagnostics", "provenance", "paths"}


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "top"
    head = parts[1]
    if head in ("runtime", "kernels", "combine", "ffn", "cli"):
        return head
    return "util" if head in UTIL else "top"


def _imports(path: pathlib.Path, mod: str, is_pkg: bool) -> set[str]:
    out = set()
    pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("moe_overlap")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("moe_overlap"):
                target = node.module
            else:
                continue
            out.add(target)
            for a in node.names:  # "from . import primitives" names a module
                out.add(f"{target}.{a.name}")
    return out


def graph():
    files = {_module(p): p for p in PKG.rglob("*.py")}
    g = {}
    for mod, path in files.items():
        deps = _imports(path, mod, path.name == "__init__.py")
        g[mod] = {d for d in deps if d in files and d != mod}
    return g


def _cycles(g):
    seen, stack, on, found = set(), [], set(), []

    def visit(n):
        seen.add(n)
        stack.append(n)
        on.add(n)
        for m in sorted(g[n]):
            if m in on:
                found.append(stack[stack.index(m):] + [m])
            elif m not in seen:
                visit(m)
        stack.pop()
        on.discard(n)

    for n in sorted(g):
        if n not in seen:
            visit(n)
    return found


def test_graph_is_read():
    g = graph()
    assert "moe_overlap.combine.overlap" in g["moe_overlap.combine.layer"]
    assert "moe_overlap.kernels.primitives" in g["moe_overlap.combine.consumer"]


def test_no_import_cycle():
    assert _cycles(graph()) == []


def test_cycle_detection_can_fail():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycles(g) == [["a", "b", "c", "a"]]


def test_imports_point_down():
    bad = []
    for mod, deps in graph().items():
        for d in deps:
            src, dst = _part(mod), _part(d)
            if src != dst and dst not in ALLOWED[src]:
                bad.append(f"{mod} ({src}) imports {d} ({dst})")
    assert bad == []


def test_host_wrappers_and_option_checks_need_no_cutedsl():
    """The kernels' host wrappers, their static option checks and the layers' option checks
    import and run with CuTe DSL unavailable (the kernel modules import cutlass at the top and
    are imported only to compile)."""
    import subprocess
    import sys
    code = (
        "import sys\n"
        "for m in ('cutlass', 'cutlass.cute', 'cuda'): sys.modules[m] = None\n"
        "import moe_overlap\n"
        "from moe_overlap.combine.grouped_gemm import GroupedGemm\n"
        "from moe_overlap.combine.overlap import check_gemm_options\n"
        "from moe_overlap.ffn.compute_reduce import FusedFFNCompute\n"
        "from moe_overlap.ffn.layers import check_compute_options\n"
        "from moe_overlap.ffn.compute_chained import ChainedFFNCompute\n"
        "assert ChainedFFNCompute.can_implement(512, 1024, 512)\n"
        "assert ChainedFFNCompute().ring_bytes(4096, 512, 1024, 512) > 0\n"
        "GroupedGemm.check_options(tile_m=64, cluster_n=1)\n"
        "assert check_gemm_options({'band_group': 2}, 128) == {'band_group': 2}\n"
        "assert FusedFFNCompute.check_options(h_pair=True) == (3, 16)\n"
        "assert check_compute_options(None, 1024, 128, 256, False) == {'h_pair': True}\n"
        "try:\n"
        "    import moe_overlap.kernels.gemm_sm90\n"
        "except ImportError:\n"
        "    print('kernel base needs cutlass')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PKG.parent, env=None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "kernel base needs cutlass"  # the block above did take effect
