"""What the README says agrees with the code and the packaging, and defines its terms before using them."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_COMMANDS = ('pip install "torch==2.13.0" "triton==3.6.0" -e ".[models]" && kdacp demo\n'
                  'pip install "torch==2.13.0" "triton==3.6.0" -e ".[test]" && python -m pytest -q\n')


def test_install_steps():
    block = README.index("```bash\n") + len("```bash\n")
    assert README[block:].startswith(FIRST_COMMANDS)  # the first screen's commands, unchanged
    install = README[:README.index("## Quick starts")]
    assert "python -m venv .venv" in install and "https://download.pytorch.org/whl/cpu" in install
    assert "several minutes" not in install and "about 10 minutes on 2 cores" in install


def test_transformers_minimum_agrees_with_prefill():
    from kdacp.integrations.transformers.prefill import MIN_TRANSFORMERS
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11's; kdacp takes 3.10)
    for extra in ("models", "test"):
        (line,) = [line for line in pyproject.splitlines() if line.startswith(f"{extra} = [")]
        assert re.search(r'"transformers>=([0-9.]+),', line).group(1) == MIN_TRANSFORMERS, line
    assert f"Needs transformers >= {MIN_TRANSFORMERS}." in README


def test_terms_are_defined_before_use():
    notation = README.index("Notation")
    for term in ("`P`", "`W`", "`HV`", "summar"):
        assert README.index(term) > notation, term
    assert "few cut" not in README
    assert "GPU summary kernels only" in README  # the K = 256 limit is theirs alone
