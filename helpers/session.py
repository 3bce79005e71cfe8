"""`setup()`: the one line at the top of every notebook."""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import helpers
from helpers.config import CourseConfig, load_config, load_dotenv_file

#: The dashboard (and the Jobs API behind it) listens on loopback only.
DASHBOARD_HOST = "127.0.0.1"
#: Ray Train's switch for its preemption watcher (read from the driver's environment at every fit()).
PREEMPTION_WATCHER_VAR = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
#: The dashboard address of the Ray this kernel started or joined, kept for re-runs of setup().
_dashboard_url: str | None = None


#: Warnings Ray's own code raises in worker processes, about nothing the learner wrote or can change: Ray Train
#: 2.60 sets a deprecated Ray Data option itself, and every Ray Data-fed fit() printed this warning.
RAY_INTERNAL_WARNINGS = ("ignore:`ExecutionOptions.exclude_resources` is deprecated:DeprecationWarning",)


def runtime_env(cfg: CourseConfig) -> dict:
    """The Ray runtime environment every worker gets: the `helpers` package and the course settings.

    `py_modules` uploads `helpers` so it imports on every node of a real cluster;
    a `sys.path` tweak would only reach the driver.
    """
    warning_filters = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *RAY_INTERNAL_WARNINGS]))
    return {"py_modules": [str(Path(helpers.__file__).parent)],
            "env_vars": {**cfg.as_env(), "PYTHONWARNINGS": warning_filters}}


def start_ray(cfg: CourseConfig) -> float:
    """Start an embedded local Ray (or connect to `RAY_ADDRESS`); return the seconds it took."""
    import ray

    global _dashboard_url

    local = {} if cfg.ray_address else {"include_dashboard": True, "dashboard_host": DASHBOARD_HOST}
    if not cfg.ray_address:
        # One machine is never preempted: skip the actor Ray Train starts on every fit() to watch for node
        # preemption. On 2 cores that process competes with the workers' start-up: fit() to first step
        # took 13 s instead of 16 s here. Clusters (RAY_ADDRESS) keep it; .env can set it either way.
        os.environ.setdefault(PREEMPTION_WATCHER_VAR, "0")
    started = time.perf_counter()
    # Ray's start-up log lines carry timestamps and pids; setup() prints its own summary instead.
    context = ray.init(address=cfg.ray_address, runtime_env=runtime_env(cfg), logging_level=logging.ERROR, **local)
    _dashboard_url = context.dashboard_url or None
    # From here on, Ray's warnings (not its info chatter) reach the notebook. Ray Data has its own
    # logger, and progress bars that change on every run: `ds.stats()` tells the same story after the fact.
    import ray.data

    logging.getLogger("ray").setLevel(logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "Progress bars disabled" notice
    ray.data.DataContext.get_current().enable_progress_bars = False
    return time.perf_counter() - started


def setup() -> CourseConfig:
    """Load `.env` and the configuration, start or reuse Ray, print the effective settings.

    Safe to re-run in the same kernel: a running Ray is reused, not started twice.
    """
    import ray
    import torch

    dotenv = load_dotenv_file()
    cfg = load_config()
    if ray.is_initialized():
        how = "already running in this kernel: reused"
    else:
        seconds = start_ray(cfg)
        how = f"connected to {cfg.ray_address}" if cfg.ray_address else "started a local Ray"
        how += f" in {seconds:.1f} s"
    resources = ray.cluster_resources()
    cfg = cfg.with_gpu(resources.get("GPU", 0) > 0)
    rows = {
        "mode": f"{cfg.mode}" + ("  (tiny runs: COURSE_SMOKE_TEST=1)" if cfg.smoke_test else "  (the lesson's real size)"),
        "device": "cuda (GPU)" if cfg.use_gpu else "cpu",
        "data dir": str(cfg.data_dir),
        "storage path": str(cfg.storage_path),
        "num_workers": str(cfg.num_workers),
        ".env": str(dotenv) if dotenv else "none found (environment and defaults)",
        "Ray": f"{ray.__version__}, {how}",
        "cluster": f"{resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs, "
        f"{len(ray.nodes())} node(s)",
        "dashboard": f"http://{_dashboard_url}" if _dashboard_url else "not running",
        "token auth": "on" if os.environ.get("RAY_AUTH_MODE") == "token" else "OFF (see RAY_AUTH_MODE)",
        "torch": torch.__version__,
    }
    width = max(map(len, rows))
    print("\n".join(f"{key:<{width}} : {value}" for key, value in rows.items()))
    return cfg


def dashboard_get(path: str, token: bool = True) -> tuple[int, object]:
    """GET `path` from the Ray dashboard of this session: the HTTP status and the JSON body (None on an error).

    With `token=True` the request carries Ray's token, as the dashboard's login page does once you paste it.
    """
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    if _dashboard_url is None:
        raise RuntimeError("No Ray dashboard is known in this kernel: run setup() first (it starts one on 127.0.0.1).")
    headers = get_auth_headers_if_auth_enabled({}) if token else {}
    request = urllib.request.Request(f"http://{_dashboard_url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None
