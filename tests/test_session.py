"""helpers.setup(): starts Ray once, prints the effective settings, ships helpers to workers."""

from __future__ import annotations

import os

import pytest
import ray

from helpers import load_config, setup
from helpers.session import PREEMPTION_WATCHER_VAR, dashboard_get


@pytest.fixture(scope="module")
def ray_setup():
    assert not ray.is_initialized()
    saved = os.environ.pop(PREEMPTION_WATCHER_VAR, None)  # as on a fresh machine
    yield
    ray.shutdown()
    os.environ.pop(PREEMPTION_WATCHER_VAR, None)
    if saved is not None:
        os.environ[PREEMPTION_WATCHER_VAR] = saved


def test_setup_starts_ray_prints_the_settings_and_survives_a_rerun(ray_setup, capsys):
    cfg = setup()
    first = capsys.readouterr().out
    for key in ("mode", "device", "data dir", "storage path", "Ray", "dashboard", "token auth", "torch"):
        assert f"\n{key}" in f"\n{first}", f"setup() should print {key!r}"
    assert "started a local Ray" in first
    assert "http://127.0.0.1:" in first, "the dashboard must listen on loopback"
    assert "token auth   : on" in first
    assert cfg.use_gpu in (True, False), "setup() resolves use_gpu='auto' against the cluster"
    assert cfg.use_gpu == (ray.cluster_resources().get("GPU", 0) > 0)
    # A local Ray is one machine: Ray Train's preemption watcher is off (every fit() reads this variable).
    assert os.environ[PREEMPTION_WATCHER_VAR] == "0"

    again = setup()
    assert "already running in this kernel: reused" in capsys.readouterr().out
    assert again == cfg


def test_workers_get_helpers_and_the_settings_through_the_runtime_env(ray_setup):
    cfg = setup()

    @ray.remote
    def inside_a_worker() -> tuple[list[str], dict]:
        import helpers.config  # noqa: F401  (imports on the worker)

        py_modules = ray.get_runtime_context().runtime_env.get("py_modules", [])
        return py_modules, {k: v for k, v in os.environ.items() if k.startswith(("COURSE_", "PYTHONWARNINGS"))}

    py_modules, env = ray.get(inside_a_worker.remote())
    # Ray's own deprecation warning about what Ray Train sets itself is filtered in every worker.
    assert "ignore:`ExecutionOptions.exclude_resources` is deprecated" in env.pop("PYTHONWARNINGS")
    # The package travels as an uploaded archive, so it imports on nodes without this checkout.
    assert len(py_modules) == 1 and py_modules[0].startswith("gcs://_ray_pkg_"), py_modules
    # Workers see the settings as the environment gave them (use_gpu may still be 'auto' there).
    assert env == load_config().as_env()
    assert env["COURSE_DATA_DIR"] == str(cfg.data_dir) and env["COURSE_STORAGE_PATH"] == str(cfg.storage_path)


def test_the_dashboard_answers_only_with_rays_token(ray_setup):
    setup()
    assert dashboard_get("/api/v0/actors", token=False)[0] == 401
    status, body = dashboard_get("/api/v0/actors")
    assert status == 200 and body["result"] is True
