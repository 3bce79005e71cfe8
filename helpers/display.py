"""Showing course code inside a notebook instead of pasting a copy that could drift."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from IPython.display import Markdown


def show_source(obj: Callable[..., Any] | ModuleType) -> Markdown:
    """The source of a helpers function or class, rendered as a Python code block."""
    return Markdown(f"```python\n{inspect.getsource(obj).rstrip()}\n```")
