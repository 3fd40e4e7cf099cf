"""README.md's Layout section lists exactly the package's modules, marks the ones that import
CuTe DSL / NVSHMEM at import time as [GPU], and names every CLI subcommand; every
`moe_overlap/...py` path that README.md, bench/NOTES.md or docs/ name exists; the Quick start
comes first, with one torch version and the index of its CPU wheel."""
import argparse
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moe_overlap"
GPU_MODULES = ("cutlass", "cuda", "nvshmem")


def _section(name: str) -> str:
    return (ROOT / "README.md").read_text().split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]


def layout_entries() -> dict[str, str]:
    """{path relative to moe_overlap/: its text (the entry's line and continuation lines)} from
    the Layout block: an entry starts at indent 6 (the package's top) or 8 (in the folder above
    it); deeper lines continue the entry before them."""
    entries, folder, last = {}, "", None
    for line in _section("Layout").splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first, _, rest = line.strip().partition(" ")
        if indent in (6, 8) and first.endswith(("/", ".py")):
            if indent == 6:
                folder = first if first.endswith("/") else ""
                path = first.rstrip("/") if first.endswith("/") else first
            else:
                path = folder + first
            last = path
            entries[path] = rest
        elif indent > 8 and last is not None:
            entries[last] += " " + line.strip()
    return entries


def test_layout_lists_every_module_and_folder():
    entries = layout_entries()
    files = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
             if p.name not in ("__init__.py", "__main__.py")}
    documented = {p for p in entries if p.endswith(".py")}
    assert documented == files, (f"in the tree, not in README's Layout: {sorted(files - documented)}"
                                 f"; in Layout, not in the tree: {sorted(documented - files)}")
    folders = {p for p in entries if not p.endswith(".py")}
    assert folders == {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}


def _imports_gpu_stack_at_import_time(path: pathlib.Path) -> bool:
    for node in ast.parse(path.read_text()).body:  # module level only: lazy imports don't count
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n.split(".")[0] in GPU_MODULES for n in names):
            return True
    return False


def test_layout_marks_modules_that_need_the_gpu_stack():
    entries = layout_entries()
    need = [p for p in entries if p.endswith(".py") and _imports_gpu_stack_at_import_time(PKG / p)]
    assert len(need) >= 6  # the kernels: gemm_sm90, tile_scheduler, primitives, three *_sm90
    assert [p for p in need if "[GPU]" not in entries[p]] == []


def test_layout_and_command_line_name_every_subcommand():
    from moe_overlap.cli import build_parser
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    cli_line = layout_entries()["cli.py"]
    named = set(re.findall(r"[a-z][a-z-]*", cli_line.split("moe-overlap", 1)[1]))
    assert named == commands, (named, commands)
    bullets = set(re.findall(r"^- `([a-z-]+)`", _section("Command line (`moe-overlap` or "
                                                          "`python3 -m moe_overlap`)"), re.M))
    assert commands <= bullets, commands - bullets


def test_every_module_path_named_in_the_docs_exists():
    docs = [ROOT / "README.md", ROOT / "bench" / "NOTES.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = [(d.relative_to(ROOT).as_posix(), p) for d in docs
               for p in sorted(set(re.findall(r"moe_overlap/[\w/]+\.py", d.read_text())))
               if not (ROOT / p).is_file()]
    assert missing == []


def test_quick_start_comes_first_with_one_torch_version_and_its_cpu_index():
    readme = (ROOT / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings[:2] == ["Quick start (fresh machine, CPU only)", "Status"], headings[:3]
    assert "report:status:begin" in _section("Status") and "docs/RESULTS.md" in _section("Status")
    quick = _section("Quick start (fresh machine, CPU only)")
    commands = [ln.strip() for ln in quick.splitlines() if ln.startswith("    ")]
    assert len({v for c in commands for v in re.findall(r"torch==([\w.]+)", c)}) == 1, commands
    cpu = [c for c in commands if "--index-url https://download.pytorch.org/whl/cpu" in c]
    assert len(cpu) == 1 and "torch==" in cpu[0] and "pytest" not in cpu[0]
    # .ci/run runs the first indented line holding "pytest": the suite with the gpu extra
    first = next(ln.strip() for ln in readme.splitlines()
                 if ln.startswith("    ") and "pytest" in ln)
    assert '".[dev,gpu]"' in first and first.endswith("pytest -q -rs tests")
