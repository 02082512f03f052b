"""`kdacp demo` runs end to end from the installed entry point and reports PASS."""
import subprocess
import sys


def test_demo_passes():
    out = subprocess.run([sys.executable, "-m", "kdacp.cli", "demo"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PASS" in out.stdout
