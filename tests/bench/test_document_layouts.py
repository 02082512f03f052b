"""``benchmarks/document_layouts.py``: per layout of log-normal documents, the attention balance and the pieces that
pass a state; the balanced placement sits between contiguous (fewest pieces, worst balance) and per-document
zigzag (level, a piece per document); bad arguments are refused."""
from __future__ import annotations

import re

from tests.helpers import run_script


def test_rows_order_the_layouts_by_balance_and_pieces(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "document_layouts", "--ranks", "2,8", "--tokens", "4096", "--seeds", "2")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {(int(P), name): (float(att), int(rec), int(cut)) for P, name, _, att, rec, cut in
            re.findall(r"^\| (\d+) \| ([\w/]+) \| (\d+) \| ([0-9.]+) \| (\d+) \| (\d+) \|$", run.stdout, re.M)}
    assert len(rows) == 8, run.stdout
    att = {name: rows[8, name][0] for _, name in rows}
    rec = {name: rows[8, name][1] for _, name in rows}
    assert att["document_zigzag"] < 1.01 and att["balanced"] < 1.05 < att["contiguous"], att
    assert rec["contiguous"] <= rec["balanced"] < rec["document_zigzag"], rec
    assert rows[2, "contiguous"][2] == 1  # one document crosses the single rank boundary


def test_bad_arguments_are_refused(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "document_layouts", "--tokens", "0")
    assert run.returncode == 2 and "must be positive" in run.stderr
