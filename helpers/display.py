"""Showing course code inside a notebook instead of pasting a copy that could drift."""

from __future__ import annotations

import inspect

from IPython.display import Markdown


def show_source(obj: object) -> Markdown:
    """The source of a helpers function or class, rendered as a Python code block."""
    return Markdown(f"```python\n{inspect.getsource(obj).rstrip()}\n```")
