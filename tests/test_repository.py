"""The repository speaks of the project only: a word of the process that made it appears in no tracked file."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORD = "ses" + "sion"  # spelled in two pieces so that this file passes its own check
FORBIDDEN = re.compile(WORD, re.IGNORECASE)  # also inside longer words (its plural)


def tracked_text_files(root: Path = ROOT) -> list[Path]:
    """Every file git tracks under ``root`` that is text (binary files, those holding a NUL byte, are skipped)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [root / n for n in names.decode().split("\0") if n]
    return [p for p in paths if p.is_file() and b"\0" not in p.read_bytes()]


def forbidden_lines(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line`` of every line of ``paths`` with the forbidden word."""
    found = []
    for path in paths:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                found.append(f"{path.relative_to(root)}:{n}")
    return found


def test_no_tracked_file_has_the_word():
    found = forbidden_lines(tracked_text_files())
    assert not found, f"the word {WORD!r} in: " + ", ".join(found)


def test_the_check_sees_the_word_in_any_case_and_inside_words(tmp_path):
    (tmp_path / "a.py").write_text(f"x = 1\n# two {WORD.capitalize()}s ago\n")
    (tmp_path / "b.bin").write_bytes(WORD.encode() + b"\0")
    (tmp_path / "c.md").write_text("nothing here\n")
    texts = [p for p in sorted(tmp_path.iterdir()) if b"\0" not in p.read_bytes()]
    assert forbidden_lines(texts, tmp_path) == ["a.py:2"]
