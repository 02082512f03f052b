"""``benchmarks/triton_prep.sh``: a Triton wheel trimmed of what a Hopper run never loads, its ``libtriton.so``
stripped of its symbol table (its dynamic symbols kept), packed and cut into parts of a set size, then joined,
checked and unpacked where it imports ahead of the installed Triton; a damaged part is refused by its checksum."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "triton_prep.sh"
TRIMMED = ("triton/backends/nvidia/bin/ptxas-blackwell", "triton/backends/nvidia/bin/nvdisasm", "triton/FileCheck",
           "triton/_C/libproton.so", "triton/instrumentation/plugin.so",
           "triton/backends/nvidia/lib/cupti/libcupti.so", "triton/backends/nvidia/lib/cupti/libnvperf_host.so")
KEPT = ("triton/__init__.py", "triton/backends/nvidia/bin/ptxas", "triton-9.9.9.dist-info/METADATA")
LIBTRITON = "triton/_C/libtriton.so"
LIB_SOURCE = "int triton_exported(int x) { return x + 1; }\nstatic int local_helper(int x) { return x * 2; }\n" \
             "int uses_helper(int x) { return local_helper(x); }\n"


def _symbols(lib: Path, dynamic: bool) -> str:
    return subprocess.run(["nm", *(["-D"] if dynamic else []), str(lib)], capture_output=True, text=True).stdout


def _wheel(path: Path) -> None:
    """A stand-in wheel: the paths the script trims and keeps, with incompressible bytes to cut into parts, and a
    real shared library with a symbol table (one local, two exported functions) as ``libtriton.so``."""
    if shutil.which("cc") is None or shutil.which("strip") is None or shutil.which("nm") is None:
        pytest.skip("a C compiler, strip and nm are needed to make the stand-in libtriton.so")
    source = path.parent / "lib.c"
    source.write_text(LIB_SOURCE)
    lib = path.parent / "libtriton.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-g", "-o", str(lib), str(source)], check=True)
    assert "local_helper" in _symbols(lib, dynamic=False)
    with zipfile.ZipFile(path, "w") as z:
        for name in TRIMMED + KEPT[1:]:
            z.writestr(name, os.urandom(40_000))
        z.writestr(KEPT[0], "__version__ = '9.9.9'\n")
        z.write(lib, LIBTRITON)


def _run(*args: str, part_bytes: int = 30_000):
    env = dict(os.environ, PART_BYTES=str(part_bytes), PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_pack_trims_and_cuts_then_install_joins_and_imports(tmp_path):
    _wheel(tmp_path / "triton.whl")
    packed = _run("pack", str(tmp_path / "triton.whl"), str(tmp_path / "parts"))
    assert packed.returncode == 0, packed.stderr[-2000:]
    parts = sorted((tmp_path / "parts").glob("triton.tar.xz.part-*"))
    assert len(parts) >= 3 and all(p.stat().st_size <= 30_000 for p in parts), parts
    installed = _run("install", str(tmp_path / "parts"), str(tmp_path / "site"))
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert "triton 9.9.9 from " + str(tmp_path / "site") in installed.stdout, installed.stdout
    assert f"export PYTHONPATH={tmp_path / 'site'}:" in installed.stdout
    assert all((tmp_path / "site" / name).is_file() for name in KEPT)
    assert not any((tmp_path / "site" / name).exists() for name in TRIMMED)
    lib = tmp_path / "site" / LIBTRITON
    assert "local_helper" not in _symbols(lib, dynamic=False)  # the symbol table is gone ...
    exported = _symbols(lib, dynamic=True)
    assert "triton_exported" in exported and "uses_helper" in exported  # ... what the loader links against is not


def test_install_refuses_a_damaged_part(tmp_path):
    _wheel(tmp_path / "triton.whl")
    assert _run("pack", str(tmp_path / "triton.whl"), str(tmp_path / "parts")).returncode == 0
    part = sorted((tmp_path / "parts").glob("triton.tar.xz.part-*"))[1]
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    installed = _run("install", str(tmp_path / "parts"), str(tmp_path / "site"))
    assert installed.returncode != 0 and "FAILED" in installed.stdout + installed.stderr
    assert not (tmp_path / "site" / "triton").exists()


def test_unknown_command_is_named():
    run = _run("fetch")
    assert run.returncode == 2 and "unknown command fetch" in run.stderr
