"""The chart writer every diagnostic chart goes through: a matplotlib (Agg) figure in, PNG bytes out.

matplotlib is imported on the first chart, not with this module: `kvtc` commands that draw nothing
never load it.
"""
from __future__ import annotations

import io
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_CAPTION: ContextVar[str | None] = ContextVar("kvtc_chart_caption", default=None)


@contextmanager
def caption(text: str | None) -> Iterator[None]:
    """Every chart finished inside the block carries `text` under its panels (e.g. which metric its errors are in)."""
    token = _CAPTION.set(text)
    try:
        yield
    finally:
        _CAPTION.reset(token)


def figure(ncols: int, per_row: int | None = None):
    """(pyplot, figure, axes) of `ncols` charts on the Agg backend, side by side, or in rows of `per_row` (the
    axes in reading order; the last row's unused cells hidden)."""
    import matplotlib  # noqa: PLC0415 - loaded on the first chart: commands that draw nothing never load it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use("Agg")

    cols = min(ncols, per_row or ncols)
    rows = -(-ncols // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[ncols:]:
        ax.set_visible(False)
    return plt, fig, flat[:ncols]


def png(plt, fig) -> bytes:
    """A finished figure -> PNG bytes (closes it)."""
    buf = io.BytesIO()
    text = _CAPTION.get()
    if text:
        fig.text(0.01, 0.01, text, fontsize=7, color="dimgray", ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", pad_inches=0.1)  # no title or legend cut
    plt.close(fig)
    return buf.getvalue()
