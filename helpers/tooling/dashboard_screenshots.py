"""Pictures of the Ray dashboard during lesson 06's section 02 run, for the lesson's section 01.

Usage, from the project's root (Linux; needs a headless Chromium: `apt-get install chromium-headless-shell`):

    COURSE_SMOKE_TEST=1 .venv/bin/python -m helpers.tooling.dashboard_screenshots [--out notebooks/images]

It starts Ray as the lesson does (`setup()`), starts section 02's training in the background, and once the run is
RUNNING, opens the dashboard's views in the browser with Ray's token (the cookie the dashboard's login page sets)
and saves one PNG per view: 06_dashboard_<view>.png. It talks to the browser over the Chrome DevTools Protocol
with aiohttp, which ray[default] installs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helpers.system import free_ports, wait_until

#: The views to take, by file name: the dashboard's route.
VIEWS = {"overview": "#/overview", "actors": "#/actors", "cluster": "#/cluster"}
#: The browsers tried, in order.
BROWSERS = ("chromium-headless-shell", "chromium", "google-chrome", "chromium-browser")
#: The dashboard's login cookie (`ray._private.authentication.authentication_constants`).
TOKEN_COOKIE = "ray-authentication-token"


def _answers(url: str) -> bool:
    """Whether `url` answers an HTTP GET within 2 s."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except OSError:
        return False


def _browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    raise SystemExit(f"No headless browser found (tried {', '.join(BROWSERS)}): apt-get install chromium-headless-shell")


async def _screenshots(debug_port: int, dashboard: str, token: str | None, out: Path, width: int, height: int) -> None:
    import aiohttp

    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{debug_port}/json/new", method="PUT")) as r:
        target = json.loads(r.read())
    async with aiohttp.ClientSession() as session, session.ws_connect(target["webSocketDebuggerUrl"],
                                                                      max_msg_size=0) as ws:
        ids = iter(range(1, 10**6))

        async def call(method: str, **params) -> dict:
            message_id = next(ids)
            await ws.send_json({"id": message_id, "method": method, "params": params})
            async for message in ws:
                reply = json.loads(message.data)
                if reply.get("id") == message_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            raise RuntimeError("the browser closed the connection")

        await call("Network.enable")
        if token:
            await call("Network.setCookie", name=TOKEN_COOKIE, value=token, url=dashboard, path="/")
        await call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        for name, route in VIEWS.items():
            await call("Page.navigate", url=f"{dashboard}/{route}")
            await asyncio.sleep(6)  # the views fetch their data after the page loads, and refresh it
            shot = await call("Page.captureScreenshot", format="png")
            path = out / f"06_dashboard_{name}.png"
            path.write_bytes(base64.b64decode(shot["data"]))
            print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="notebooks/images", help="folder for the PNG files")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from ray.train import LoggingConfig, RunConfig
    from ray.train.torch import TorchTrainer

    from helpers import setup
    from helpers.ingest import SMOKE_ROWS, prepare_ray_data_training, train_loop_per_worker
    from helpers.runs import new_run_name
    from helpers.tooling import ray_internals
    from helpers.troubleshooting import run_workers

    os.environ["RAY_TRAIN_ENABLE_STATE_TRACKING"] = "1"
    cfg = setup()
    from helpers import session

    dashboard = f"http://{session._dashboard_url}"
    _, datasets, scaling = prepare_ray_data_training(cfg, SMOKE_ROWS)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"num_epochs": 3, "global_batch_size": 128, "lr": 1e-3, "seed": 0,
                           "prefetch_batches": 1, "shuffle_buffer": None},
        datasets=datasets, scaling_config=scaling,
        run_config=RunConfig(storage_path=str(cfg.storage_path), name=new_run_name("06_observed"),
                             logging_config=LoggingConfig(log_level="WARNING")))
    running = ThreadPoolExecutor(max_workers=1).submit(trainer.fit)
    # the Train API lists the workers once the attempt is RUNNING; `True` when the run ended before
    if wait_until(lambda: run_workers(trainer.run_config.name) or running.done(), 300, 1,
                  what="the run reaching RUNNING") is True:
        raise SystemExit("the run never reached RUNNING")

    header = next((value for key, value in ray_internals.auth_headers().items() if key.lower() == "authorization"), "")
    token = header.removeprefix("Bearer ") or None
    (debug_port,) = free_ports(1)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:  # the browser may write as it exits
        browser = subprocess.Popen(
            [_browser(), "--headless", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={debug_port}",
             f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until(functools.partial(_answers, f"http://127.0.0.1:{debug_port}/json/version"), 30, 0.5,
                       what="the headless browser answering")
            asyncio.run(_screenshots(debug_port, dashboard, token, out, args.width, args.height))
        finally:
            os.killpg(browser.pid, signal.SIGTERM)  # the browser and the processes it started (a wrapper script's too)
            browser.wait(timeout=30)
    running.result()
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
