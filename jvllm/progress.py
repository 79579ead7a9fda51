"""Progress bars: `tqdm.auto` (a notebook widget) only where the widget can be drawn.

In a Jupyter kernel without ipywidgets, `tqdm.auto` falls back to the text bar but first warns
"TqdmWarning: IProgress not found. Please update jupyter and ipywidgets." on every bar. `bar()`
decides once per process: the widget bar when ipywidgets is importable, else tqdm's plain text bar
(which renders fine in notebooks and terminals alike). Use it instead of importing tqdm.auto.
"""
from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=1)
def bar_class():
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm


def bar(*args, **kwargs):
    """A tqdm bar (same arguments as tqdm.tqdm)."""
    return bar_class()(*args, **kwargs)
