"""Ray's token authentication: where this process reads the token from, sending it when joining a cluster, and
whether the cluster requires it (the "token auth" line `setup()` prints)."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.tooling import ray_internals

#: Where Ray reads a cluster's token from, in its order (Ray 2.60: ray/_private/authentication/).
TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")


def token_source() -> str | None:
    """Where this process would read Ray's token from: a variable, or the default file; None when it has none."""
    for name in TOKEN_VARS:
        if os.environ.get(name, "").strip():
            return name
    return str(DEFAULT_TOKEN_FILE) if DEFAULT_TOKEN_FILE.expanduser().is_file() else None


def send_token_if_given() -> bool:
    """Before joining a cluster: send Ray's token when one is given, by setting RAY_AUTH_MODE=token.

    Ray sends the token only with RAY_AUTH_MODE=token in the joining process's environment; with
    RAY_AUTH_TOKEN alone, a cluster with token auth refuses the connection. An explicit RAY_AUTH_MODE wins.
    Returns whether this process now sends the token.
    """
    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
    if mode:
        return mode == "token"
    if token_source() is None:
        return False
    ray_internals.enable_token_auth()  # what Ray itself does for a local cluster: RAY_AUTH_MODE=token, config reloaded
    return True


def _token_required() -> bool:
    """True when the Ray node running this code enforces token authentication (read inside a Ray worker)."""
    return ray_internals.token_auth_enabled()


def token_auth_state(joined: bool) -> str:
    """The cluster's token authentication, as Ray reports it: on the cluster's side when this kernel joined one.

    A local Ray runs with this process's mode. A joined cluster is asked by a small task on one of its nodes:
    this kernel sending a token does not mean the cluster requires one.
    """
    import ray

    if joined:
        required = ray.get(ray.remote(num_cpus=0)(_token_required).remote(), timeout=120)
    else:
        required = ray_internals.token_auth_enabled()
    if not required:
        return "OFF: anyone who reaches the cluster's ports can run code on it (see the README, Security defaults)"
    return f"on: Ray requires its token (this kernel's from {token_source()})"
