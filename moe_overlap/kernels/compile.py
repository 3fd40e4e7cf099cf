"""Compile tools shared by the kernels and their tests: keep PTX / cubin of a ``cute.compile``
in memory, find nvdisasm, and turn a cubin into SASS text."""


def compile_keep(launch, *args):
    """``cute.compile`` keeping PTX and cubin (``.__ptx__``, ``.__cubin__``) in memory; the files
    CuTe DSL dumps on the way go to a temporary folder, not the working directory."""
    import tempfile

    import cutlass.cute as cute
    opts = [cute.KeepPTX(), cute.KeepCUBIN()]
    with tempfile.TemporaryDirectory(prefix="switch_dump_") as d:
        try:
            from cutlass.base_dsl.compiler import DumpDir
            opts.append(DumpDir(d))
        except Exception:  # noqa: BLE001 - older/newer DSL without the option: dump to cwd
            pass
        c = cute.compile[tuple(opts)](launch, *args)
        _ = (c.__ptx__, c.__cubin__)  # read while the folder exists
    return c


def find_nvdisasm() -> str | None:
    """Path of an nvdisasm binary (PATH, the nvidia-cuda-nvdisasm wheel, /usr/local/cuda*), or
    None."""
    import glob
    import shutil
    p = shutil.which("nvdisasm")
    if p:
        return p
    try:
        from importlib import metadata
        for f in metadata.distribution("nvidia-cuda-nvdisasm").files or ():
            if f.name == "nvdisasm":
                return str(f.locate())
    except Exception:  # noqa: BLE001 - wheel not installed
        pass
    found = sorted(glob.glob("/usr/local/cuda*/bin/nvdisasm"))
    return found[-1] if found else None


def sass_of(cubin: bytes, nvdisasm: str | None = None) -> str:
    """SASS text of a cubin (raises RuntimeError when no nvdisasm is found)."""
    import subprocess
    import tempfile
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise RuntimeError("no nvdisasm found (pip install nvidia-cuda-nvdisasm)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin if isinstance(cubin, bytes) else cubin.encode())
        f.flush()
        return subprocess.run([tool, "-c", f.name], check=True, capture_output=True,
                              text=True).stdout


def kept_ptx(compiled) -> str:
    """The PTX text a ``cute.compile`` kept (``KeepPTX``); raises RuntimeError when there is none,
    so a check of the PTX fails instead of passing or skipping when the DSL keeps nothing."""
    ptx = getattr(compiled, "__ptx__", None)
    if not ptx:
        raise RuntimeError("CuTe DSL kept no PTX (KeepPTX / keep_ptx=True asked for it)")
    return ptx


def kept_cubin(compiled) -> bytes:
    """The cubin a ``cute.compile`` kept (``KeepCUBIN``); raises RuntimeError when there is none."""
    cubin = getattr(compiled, "__cubin__", None)
    if not cubin:
        raise RuntimeError("CuTe DSL kept no cubin (KeepCUBIN / keep_ptx=True asked for it)")
    return cubin


def require_nvdisasm() -> str:
    """find_nvdisasm(), raising RuntimeError when there is none (it is a dev dependency:
    nvidia-cuda-nvdisasm)."""
    tool = find_nvdisasm()
    if tool is None:
        raise RuntimeError("no nvdisasm found (pip install nvidia-cuda-nvdisasm, in the dev extra)")
    return tool
