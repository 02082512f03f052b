"""One harness for every benchmark suite: prints the table, writes JSON, Markdown and PNG.

A suite is a function returning rows (flat dicts of numbers and strings). The harness adds the
run's context (date, device, versions, commit) and writes ``<suite>.json``, ``<suite>.md`` and,
when matplotlib is installed, one PNG per plot spec (one line per series, ``y`` against ``x``).
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class PlotSpec:
    """How to plot a suite's rows: ``y`` against ``x``, one line per distinct ``series`` value (or,
    when ``y`` names several columns, one line per column), one panel per distinct ``panel`` value.
    ``where = (column, value)``: lines only from rows with that value; ``points = (column, prefix)``:
    rows whose value starts with ``prefix`` are drawn as unconnected markers over the lines."""

    x: str
    y: str | tuple[str, ...]
    series: str | None = None
    panel: str | None = None
    title: str = ""
    ylabel: str = ""
    logx: bool = True
    logy: bool = False
    bars: bool = False  # ``x`` is a category: one horizontal bar per row instead of lines
    where: tuple[str, str] | None = None
    points: tuple[str, str] | None = None


def git_commit(path: Path) -> str:
    """Short commit of the checkout holding ``path``, with ``+dirty`` when tracked files differ from it
    (results of uncommitted code are not labelled as a commit's); ``"unknown"`` outside git."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=path, timeout=5).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return commit or "unknown"


def run_context() -> dict:
    """Date, device, library versions and git commit of this run."""
    commit = git_commit(Path(__file__).parent)
    import triton
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}"
    return str(v)


def markdown_table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# Line styles by series: lines that coincide (equal values) still show, the later ones dashed, thinner
# and with smaller markers drawn over the earlier ones.
_LINE_STYLES = (dict(linestyle="-", marker="o", markersize=9, linewidth=3.0),
                dict(linestyle="--", marker="s", markersize=6, linewidth=2.0),
                dict(linestyle=":", marker="^", markersize=4, linewidth=1.5),
                dict(linestyle="-.", marker="x", markersize=5, linewidth=1.0))


def _figure(rows: list[dict], spec: PlotSpec, context: dict):
    """The matplotlib figure of ``rows`` by ``spec`` (None when the rows do not fit it): one panel per
    ``spec.panel`` value, side by side for lines and one above the other for bars (their long labels
    need the width), each titled by its panel value, under the spec's title and the run's context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    marks = []
    if spec.points:
        column, prefix = spec.points
        marks = [r for r in rows if str(r.get(column, "")).startswith(prefix)]
    if spec.where:
        rows = [r for r in rows if r.get(spec.where[0]) == spec.where[1]]
    if not rows or any(spec.x not in r for r in rows):
        return None  # rows of another shape (an older or partial run): no plot, the table still stands
    if not spec.bars and len({r.get(spec.x) for r in rows}) < 2:
        return None  # a line needs two x values (e.g. "vs ranks" from a run at one world size)
    panels = list(dict.fromkeys(r.get(spec.panel) for r in rows)) if spec.panel else [None]
    if spec.bars:
        fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.45 * len(rows) + 0.7 * len(panels)),
                                 squeeze=False)
        axes = axes[:, 0]
    else:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.3), squeeze=False)
        axes = axes[0]
    for ax, panel in zip(axes, panels):
        sel = [r for r in rows if spec.panel is None or r.get(spec.panel) == panel]
        if spec.panel:
            ax.set_title(f"{spec.panel}: {panel}", fontsize=10)
        if spec.bars:
            names = [str(r[spec.x]) for r in sel]
            # kdacp's rows in one colour, everything else (FLA's) in another
            colors = ["tab:blue" if n.startswith("kdacp") else "tab:gray" for n in names]
            bars = ax.barh(names, [r[spec.y] for r in sel], color=colors)
            ax.bar_label(bars, fmt="%.3f", padding=3, fontsize=8)
            ax.margins(x=0.15)  # room for the labels
            ax.invert_yaxis()
            ax.set_xlabel(spec.ylabel or str(spec.y))
            ax.grid(alpha=0.3, axis="x")
            continue
        if isinstance(spec.y, tuple):
            lines = {y: [(r[spec.x], r.get(y)) for r in sel] for y in spec.y}
        else:
            lines = {name: [(r[spec.x], r.get(spec.y)) for r in sel if r[spec.series] == name]
                     for name in dict.fromkeys(r[spec.series] for r in sel)}
        for i, (name, pts) in enumerate(lines.items()):
            pts = sorted(p for p in pts if p[1] is not None)
            if pts:
                line, = ax.plot(*zip(*pts), label=str(name), **_LINE_STYLES[i % len(_LINE_STYLES)])
                if isinstance(spec.y, tuple):
                    got = sorted((r[spec.x], r[name]) for r in marks if r.get(name) is not None)
                    if got:
                        ax.plot(*zip(*got), linestyle="none", marker="x", markersize=9, color=line.get_color(),
                                label=f"{name} measured")
        if spec.logx:
            ax.set_xscale("log", base=2)
        if spec.logy:
            ax.set_yscale("log")
        ax.set_xlabel(spec.x)
        ax.set_ylabel(spec.ylabel or str(spec.y))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    where = f"{context['gpus']}x {context['device']}" if context["gpus"] else "CPU"
    # wrapped to the figure's width (about 11 characters an inch at 10 points)
    title = textwrap.wrap(spec.title, width=int(11 * fig.get_figwidth())) if spec.title else []
    fig.suptitle("\n".join([*title, f"{where}, commit {context['commit']}, {context['date']}"]), fontsize=10)
    fig.tight_layout()
    return fig


def _plot(rows: list[dict], spec: PlotSpec, path: Path, context: dict) -> bool:
    """Write :func:`_figure` to ``path``; False when matplotlib is missing or the rows do not fit."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = _figure(rows, spec, context)
    if fig is None:
        return False
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(suite: str, rows: list[dict], out_dir: str | Path, plots: dict[str, PlotSpec] | None = None,
                  context: dict | None = None, markdown=markdown_table, complete: bool = True) -> list[Path]:
    """Write ``<suite>.json`` (context + rows), ``<suite>.md`` and one ``<stem>.png`` per entry of
    ``plots`` (when matplotlib is installed); return the paths written. ``context`` defaults to
    this run's (:func:`run_context`); pass a recorded run's to re-render its results. ``markdown``
    renders the rows (a suite whose rows are of several kinds gives its own). ``complete=False``: the
    rows of a run still going or stopped early (the JSON's ``complete`` and the Markdown say so)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    context = run_context() if context is None else context
    paths = [out / f"{suite}.json", out / f"{suite}.md"]
    paths[0].write_text(json.dumps({"suite": suite, "context": context, "complete": complete, "rows": rows},
                                   indent=2))
    head = ", ".join(f"{k} {v}" for k, v in context.items())
    partial = "" if complete else f"Partial: the {len(rows)} rows measured before the run ended or stopped.\n\n"
    paths[1].write_text(f"# kdacp bench: {suite}\n\n{head}\n\n{partial}{markdown(rows)}\n")
    for stem, spec in (plots or {}).items():
        if rows and _plot(rows, spec, out / f"{stem}.png", context):
            paths.append(out / f"{stem}.png")
    return paths


def load_module_file(path: str, name: str):
    """The Python file ``path`` imported as module ``name`` (registered in ``sys.modules``): an earlier
    version of a kdacp module for an A/B benchmark; a dotted ``name`` inside a kdacp package lets the
    file's relative imports resolve there."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
