"""``benchmarks/triton_prep.sh``: a Triton wheel trimmed of what a Hopper run never loads, packed and cut into
parts of a set size, then joined, checked and unpacked where it imports ahead of the installed Triton; a damaged
part is refused by its checksum."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "triton_prep.sh"
TRIMMED = ("triton/backends/nvidia/bin/ptxas-blackwell", "triton/_C/libproton.so", "triton/instrumentation/plugin.so",
           "triton/backends/nvidia/lib/cupti/libcupti_static.a", "triton/backends/nvidia/lib/cupti/libnvperf_host.so")
KEPT = ("triton/__init__.py", "triton/backends/nvidia/bin/ptxas", "triton/backends/nvidia/lib/cupti/libcupti.so",
        "triton-9.9.9.dist-info/METADATA")


def _wheel(path: Path) -> None:
    """A stand-in wheel: the paths the script trims and keeps, with incompressible bytes to cut into parts."""
    with zipfile.ZipFile(path, "w") as z:
        for name in TRIMMED + KEPT[1:]:
            z.writestr(name, os.urandom(40_000))
        z.writestr(KEPT[0], "__version__ = '9.9.9'\n")


def _run(*args: str, part_bytes: int = 30_000):
    env = dict(os.environ, PART_BYTES=str(part_bytes), PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_pack_trims_and_cuts_then_install_joins_and_imports(tmp_path):
    _wheel(tmp_path / "triton.whl")
    packed = _run("pack", str(tmp_path / "triton.whl"), str(tmp_path / "parts"))
    assert packed.returncode == 0, packed.stderr[-2000:]
    parts = sorted((tmp_path / "parts").glob("triton.tar.xz.part-*"))
    assert len(parts) >= 4 and all(p.stat().st_size <= 30_000 for p in parts), parts
    installed = _run("install", str(tmp_path / "parts"), str(tmp_path / "site"))
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert "triton 9.9.9 from " + str(tmp_path / "site") in installed.stdout, installed.stdout
    assert f"export PYTHONPATH={tmp_path / 'site'}:" in installed.stdout
    assert all((tmp_path / "site" / name).is_file() for name in KEPT)
    assert not any((tmp_path / "site" / name).exists() for name in TRIMMED)


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
