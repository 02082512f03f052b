"""The harness's plots: panel titles that neither overlap nor leave the figure, and coinciding lines that
stay distinguishable."""
import pytest

from kdacp.bench import layer, virtual
from kdacp.bench.harness import _figure

CONTEXT = dict(date="2026-12-02 06:00 UTC", device="cpu", gpus=0, torch="t", triton="t", commit="abc1234")


@pytest.fixture
def plt():
    return pytest.importorskip("matplotlib.pyplot")


def _extents(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [ax.title for ax in fig.axes] + [fig._suptitle]
    return [t.get_window_extent(renderer) for t in texts if t.get_text()], fig.bbox


def test_layer_suite_panel_titles_fit_and_do_not_overlap(plt):
    rows = [dict(batch=b, run=run, label=f"{run} ({b})", ms=1.0 + i) for b in ("one_sequence", "docs7", "lognormal")
            for i, run in enumerate(("kdacp_one_rank", "kdacp_state", "kdacp_ulysses", "kdacp_hybrid"))]
    fig = _figure(rows, layer.PLOTS["layer_step"], CONTEXT)
    boxes, page = _extents(fig)
    assert len(boxes) == 4  # three panels and the figure's title
    for i, a in enumerate(boxes):
        assert page.x0 <= a.x0 and a.x1 <= page.x1 and page.y0 <= a.y0 and a.y1 <= page.y1, "a title is cut"
        assert not any(a.overlaps(b) for b in boxes[i + 1:]), "titles overlap"
    assert [ax.get_title() for ax in fig.axes] == ["batch: one_sequence", "batch: docs7", "batch: lognormal"]
    plt.close(fig)


def test_coinciding_lines_stay_distinguishable(plt):
    rows = [dict(P=P, p2p_state_err=1e-7, allgather_state_err=1e-7, scan_state_err=1e-7) for P in (2, 4, 8)]
    fig = _figure(rows, virtual.PLOTS["virtual_error"], CONTEXT)
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3
    styles = {(ln.get_linestyle(), ln.get_marker(), ln.get_markersize()) for ln in lines}
    assert len(styles) == 3  # each line its own dash, marker and size, the later ones drawn smaller on top
    assert "lines lie on one another" in fig._suptitle.get_text()
    boxes, page = _extents(fig)
    assert all(page.x0 <= b.x0 and b.x1 <= page.x1 for b in boxes), "the title is cut"
    plt.close(fig)
