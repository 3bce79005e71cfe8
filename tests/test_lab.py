"""`make lab`'s JupyterLab: headless on 127.0.0.1 with a token, serving notebooks/ with a working kernel.

The server and its kernel for real: tests/test_lab_notebook.py.
"""

from __future__ import annotations

from tests.support import lab_recipe as _lab_recipe


def test_make_lab_binds_to_loopback_and_serves_notebooks():
    recipe = _lab_recipe()
    assert "jupyter lab" in recipe
    assert "--ServerApp.ip=127.0.0.1" in recipe and "--ServerApp.root_dir=notebooks" in recipe
