"""A CuTe DSL pitfall, checked over every kernel source: a name bound by a nested tuple target
(``_, (a, b) = f()``) is not in the DSL's scope (its preprocessor takes names from plain and
one-level tuple targets only), so assigning it inside a runtime ``if`` / ``while`` changes it
inside that region only; after it the old value comes back, silently. The planner kernel's
overflow plan left its segment fields unwritten that way (bench/NOTES.md, helper i35h). Bind
such a name by a plain or one-level target before the region instead."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _nested_tuple_names(stmt) -> set:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else \
        [stmt.target] if isinstance(stmt, ast.For) else []
    names = set()
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                if isinstance(e, (ast.Tuple, ast.List, ast.Starred)):
                    names |= {n.id for n in ast.walk(e) if isinstance(n, ast.Name)}
    return names - {"_"}


def _is_kernel(fn) -> bool:
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d) in ("cute.kernel", "cute.jit")
               for d in fn.decorator_list)


def dropped_assignments(source: str) -> list[tuple[str, int, list[str]]]:
    """(function, line of the runtime if / while, names) where a name bound by a nested tuple
    target outside that region is assigned inside it, in @cute.kernel / @cute.jit functions."""
    hits = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and _is_kernel(fn)):
            continue
        nodes = list(ast.walk(fn))
        for region in nodes:
            if not isinstance(region, (ast.If, ast.While)) or \
                    "const_expr" in ast.unparse(region.test):  # compile-time: plain Python
                continue
            inside = {id(x) for x in ast.walk(region)}
            nested = set()
            for s in nodes:
                if id(s) not in inside and isinstance(s, (ast.Assign, ast.For)):
                    nested |= _nested_tuple_names(s)
            stored = {n.id for n in ast.walk(region)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            if stored & nested:
                hits.append((fn.name, region.lineno, sorted(stored & nested)))
    return hits


def test_the_check_finds_the_pattern():
    src = ("@cute.kernel\ndef k(x):\n    _, (a, b) = f(x)\n    if x > 0:\n        b = 0\n"
           "    s, t = f(x)\n    if x > 1:\n        t = 0\n"
           "    if cutlass.const_expr(True):\n        a = 1\n")
    assert dropped_assignments(src) == [("k", 4, ["b"])]


def test_no_kernel_assigns_a_nested_tuple_name_in_a_runtime_region():
    hits = {p.relative_to(ROOT).as_posix(): h for p in sorted((ROOT / "moe_overlap").rglob("*.py"))
            if (h := dropped_assignments(p.read_text()))}
    assert not hits, hits
