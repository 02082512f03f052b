"""The Python snippets of the README and of the user guide (docs/GUIDE.md) run as written, and the README's
figures link to rows of benchmarks/RESULTS.md.

Each snippet is a ```python block preceded by ``<!-- snippet: NAME cpu|gpu -->``; its first comment line says
how it is launched (``# python FILE`` or ``# torchrun --nproc-per-node N FILE``). The CPU ones run here under
that launcher (torchrun's ranks on gloo) and must exit with status 0 and print what :data:`EXPECTED` asks of
them (the two whole-model ones under the ``slow`` mark); the GPU ones run under the ``gpu`` mark.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.multiprocess import run_command

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "GUIDE.md"
DOCS = (README, GUIDE)  # the pages whose snippets run
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

MARKER = re.compile(r"<!-- snippet: (\w+) (cpu|gpu) -->\n```python\n(.*?)\n```", re.S)
LAUNCH = re.compile(r"# (?:python (?P<file>\S+\.py)|torchrun --nproc-per-node (?P<nproc>\d+) (?P<tfile>\S+\.py))$")
TIMEOUT_S = 600
# Whole transformers models, 30-40 s each on 2 cores; tests/models covers the same paths in the default run.
SLOW = {"hf_fsdp_cpu", "prefill_cpu"}


# A printed figure such as 3.3e-07 (and no more: ranks print to one pipe, so one rank's line may run into
# another's without a newline between them).
NUMBER = r"([-+]?\d+(?:\.\d*)?(?:e[-+]?\d+)?)"


def _small(text: str) -> float:
    return float(text)


def _check_op(out: str) -> None:
    rows = re.findall(r"rank (\d): tokens \d+-\d+, output error " + NUMBER + ", final state error " + NUMBER, out)
    assert sorted(r[0] for r in rows) == ["0", "1"], out
    assert all(_small(o) < 1e-5 and _small(s) < 1e-5 for _, o, s in rows), out


def _check_gdn(out: str) -> None:
    found = re.findall(r"output \(1, 256, 4, 32\), final state \(2, 4, 32, 32\), error against the oracle " + NUMBER, out)
    assert len(found) == 1 and _small(found[0]) < 1e-5, out


def _check_layer(out: str) -> None:
    rows = re.findall(r"rank (\d): output error " + NUMBER, out)
    assert sorted(r[0] for r in rows) == ["0", "1"], out
    assert all(_small(e) < 1e-5 for _, e in rows), out


def _check_model(out: str) -> None:
    found = re.findall(r"loss " + NUMBER + ", unmodified model " + NUMBER, out)
    assert len(found) == 1, out
    loss, expected = map(float, found[0])
    assert abs(loss - expected) <= 1e-5 * abs(expected), out


def _check_prefill(out: str) -> None:
    rows = re.findall(r"rank (\d): cache of 40 tokens \(layer 1 is attention\), last-token logits error " + NUMBER + ", "
                      r"new tokens (\[[\d, ]*\])", out)
    assert sorted(r[0] for r in rows) == ["0", "1"], out
    assert all(_small(e) < 1e-5 for _, e, _ in rows), out
    tokens = {t for _, _, t in rows}
    assert len(tokens) == 1 and len(eval(tokens.pop())) == 8, out  # the same 8 new tokens on every rank


def _check_op_gpu(out: str) -> None:
    rows = re.findall(r"rank (\d): output \(1, 32768, 32, 128\), final states \(3, 32, 128, 128\), "
                      r"gradients finite: True", out)
    assert sorted(rows) == ["0", "1"], out


EXPECTED = {"op_cpu": _check_op, "gdn_cpu": _check_gdn, "layer_cpu": _check_layer, "hf_fsdp_cpu": _check_model,
            "prefill_cpu": _check_prefill, "op_gpu": _check_op_gpu}


def _docs_text() -> str:
    return "\n".join(page.read_text() for page in DOCS)


def snippets(text: str | None = None) -> dict[str, tuple[str, str]]:
    """``{name: (kind, code)}`` of every marked snippet of :data:`DOCS` (or of ``text``)."""
    found = {}
    for name, kind, code in MARKER.findall(_docs_text() if text is None else text):
        assert name not in found, f"two snippets are named {name!r}"
        found[name] = (kind, code + "\n")
    return found


def launch_command(code: str, folder: Path) -> list[str]:
    """The command the snippet's first comment names, with the snippet written to its file in ``folder``."""
    first = code.splitlines()[0]
    m = LAUNCH.match(first)
    assert m, f"a snippet's first line must say how it is launched ('# python FILE' or " \
              f"'# torchrun --nproc-per-node N FILE'), got {first!r}"
    path = folder / (m["file"] or m["tfile"])
    path.write_text(code)
    if m["file"]:
        return [sys.executable, str(path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", m["nproc"], str(path)]


def run_snippet(name: str, tmp_path: Path) -> str:
    kind, code = snippets()[name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = run_command(launch_command(code, tmp_path), TIMEOUT_S, cwd=tmp_path, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"snippet {name} exited with {done.returncode}:\n{out[-4000:]}"
    return done.stdout


def _cases():
    for name, (kind, _) in snippets().items():
        marks = [pytest.mark.gpu] if kind == "gpu" else [pytest.mark.slow] if name in SLOW else []
        yield pytest.param(name, marks=marks, id=name)


def test_every_python_block_is_a_marked_snippet_with_a_launcher_and_an_expectation(tmp_path):
    assert _docs_text().count("```python") == len(snippets()), "a ```python block of the docs has no snippet marker"
    assert set(snippets()) == set(EXPECTED), "each snippet needs its expected output in EXPECTED"
    for _, code in snippets().values():
        launch_command(code, tmp_path)


@pytest.mark.parametrize("name", list(_cases()))
def test_readme_snippet_runs_and_prints_what_it_promises(name, tmp_path):
    kind, code = snippets()[name]
    if kind == "gpu":
        nproc = LAUNCH.match(code.splitlines()[0])["nproc"]
        if torch.cuda.device_count() < int(nproc or 1):
            pytest.skip(f"needs {nproc} GPUs")
    EXPECTED[name](run_snippet(name, tmp_path))


def test_launcher_line_is_required(tmp_path):
    """A snippet whose first line names no launcher is refused (the check above can fail)."""
    with pytest.raises(AssertionError, match="how it is launched"):
        launch_command("import torch\n", tmp_path)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_results_link_of_the_readme_names_a_heading_of_results():
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", RESULTS.read_text(), re.M)}
    links = re.findall(r"benchmarks/RESULTS\.md#([\w\-]+)", README.read_text())
    assert links, "the README's figures link to their rows in benchmarks/RESULTS.md"
    missing = sorted(set(links) - anchors)
    assert not missing, f"README links to RESULTS.md anchors that no heading makes: {missing}"


def test_every_anchor_link_between_the_docs_names_a_heading_of_its_page():
    """Links such as ``docs/GUIDE.md#limits`` from the README and the guide land on a heading of that page."""
    missing = []
    for page in DOCS:
        for target, anchor in re.findall(r"\]\(([\w./-]+\.md)#([\w\-]+)\)", page.read_text()):
            path = (page.parent / target).resolve()
            if path == RESULTS.resolve():
                continue  # checked above, with the figures
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)} if path.exists() else set()
            if anchor not in anchors:
                missing.append(f"{page.name} -> {target}#{anchor}")
    assert not missing, f"links to headings that do not exist: {missing}"

