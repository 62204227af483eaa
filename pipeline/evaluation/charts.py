"""The chart writer every diagnostic chart goes through: a matplotlib (Agg) figure in, PNG bytes out.

matplotlib is imported on the first chart, not with this module: `kvtc` commands that draw nothing
never load it.
"""
from __future__ import annotations

import io


def figure(ncols: int):
    """(pyplot, figure, axes row) of `ncols` side-by-side charts on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 3.8), squeeze=False)
    return plt, fig, axes[0]


def png(plt, fig) -> bytes:
    """A finished figure -> PNG bytes (closes it)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
