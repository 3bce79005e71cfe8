"""The suite's pytest set-up, for notebooks/ and tests/ alike: two plugins under tests/plugins/.

- `nbval_ray`: how nbval compares the output of notebooks that run Ray (Ray's forwarded log lines leave the
  comparison; those that report an error fail the cell unless its metadata expects them).
- `leftover_processes`: the suite must not leave Ray, kernels or JupyterLab running.
- `session_storage`: unless COURSE_STORAGE_PATH is set, the session's runs and summaries go to a temporary folder of
  its own, not to `<repo>/runs`.

The fixtures the test modules share are in tests/conftest.py.
"""

pytest_plugins = ["tests.plugins.nbval_ray", "tests.plugins.leftover_processes", "tests.plugins.session_storage"]
