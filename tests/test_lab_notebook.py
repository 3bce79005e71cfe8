"""A headless JupyterLab serves the notebooks and runs a kernel that imports helpers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
from tornado.websocket import websocket_connect

from helpers.config import REPO_ROOT
from helpers.system import free_ports, wait_until
from tests.support import lab_recipe as _lab_recipe

pytestmark = pytest.mark.notebook  # JupyterLab and a kernel


def _request(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        return error.code, None


async def _run_in_kernel(ws_url: str, code: str, timeout: float = 60) -> str:
    connection = await websocket_connect(ws_url)
    msg_id = uuid.uuid4().hex
    await connection.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex,
                   "msg_type": "execute_request", "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True},
    }))
    output, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            raw = await asyncio.wait_for(connection.read_message(), timeout=deadline - time.monotonic())
            message = json.loads(raw)
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["header"]["msg_type"]
            if kind == "stream":
                output.append(message["content"]["text"])
            elif kind == "error":
                raise AssertionError(f"kernel error: {message['content']['ename']}: {message['content']['evalue']}")
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                return "".join(output)
        raise AssertionError("the kernel did not finish in time")
    finally:
        connection.close()


@pytest.fixture
def lab(tmp_path):
    """JupyterLab started as `make lab` starts it, plus a fixed token and port, headless."""
    (port,), token = free_ports(host="127.0.0.1"), uuid.uuid4().hex
    _jupyter, _lab, *options = _lab_recipe().split()  # "$(BIN)/jupyter lab --ServerApp.ip=... ..."
    options = [option for option in options if not option.startswith(("--ServerApp.port=", "$("))]
    options += ["--allow-root"] if os.geteuid() == 0 else []
    command = [sys.executable, "-m", "jupyterlab", *options, f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", "--no-browser"]
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def answers() -> bool:
            assert server.poll() is None, f"JupyterLab exited early:\n{(tmp_path / 'lab.log').read_text()}"
            try:
                return _request(f"{base}/api/status?token={token}")[0] == 200
            except OSError:
                return False

        wait_until(answers, 120, 1, "JupyterLab's API answering")
        yield base, token
        _request(f"{base}/api/shutdown?token={token}", method="POST")
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def test_lab_serves_the_notebooks_and_runs_a_kernel_that_imports_helpers(lab):
    base, token = lab
    assert _request(f"{base}/api/contents")[0] == 403, "the API must require the token"

    status, listing = _request(f"{base}/api/contents?token={token}")
    assert status == 200
    names = {item["name"] for item in listing["content"]}
    assert {"00_ray_core.ipynb", "01_single_gpu_pytorch.ipynb"} <= names

    status, session = _request(f"{base}/api/sessions?token={token}", method="POST", body={
        "path": "00_ray_core.ipynb", "type": "notebook", "name": "", "kernel": {"name": "python3"}})
    assert status == 201
    kernel_id = session["kernel"]["id"]
    ws_url = f"ws://127.0.0.1:{base.rsplit(':', 1)[1]}/api/kernels/{kernel_id}/channels?token={token}"
    out = asyncio.run(_run_in_kernel(ws_url, "import os, helpers\nprint(os.getcwd())\nprint(helpers.__file__)"))
    cwd, module_file = out.split()
    assert cwd == str(REPO_ROOT / "notebooks"), "kernels must start in notebooks/ (where .env is found upwards)"
    assert module_file == str(REPO_ROOT / "helpers" / "__init__.py")

    assert _request(f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE")[0] == 204
    assert _request(f"{base}/api/kernels?token={token}")[1] == []

    # The course's settings (deploy/jupyterlab/, installed by `make install`) change JupyterLab's defaults: no
    # "get notified about Jupyter news?" prompt on the first screen, no update check.
    status, settings = _request(f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}")
    defaults = {name: spec.get("default") for name, spec in settings["schema"]["properties"].items()}
    assert status == 200 and (defaults["fetchNews"], defaults["checkForUpdates"]) == ("false", False), defaults
