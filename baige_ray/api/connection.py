"""Joining the user's Ray cluster the way Ray's security documentation says, or saying what to set.

A head started with `ray start` asks drivers for its authentication token. Ray's own `ray.init()` turns
token authentication on for a local cluster it starts, not for one it joins: a driver that joins with
RAY_AUTH_MODE unset is refused (`InvalidAuthToken`) until it gives up with a bare ConnectionError.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

TOKEN_AUTH_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


def token_available() -> bool:
    """Whether this machine holds a Ray authentication token where Ray looks for one."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (Path.home() / ".ray" / "auth_token").is_file()


def connect_ray(address: str | None = None, **options: Any) -> Any:
    """`ray.init(address, **options)`. Joining a cluster (`address`, or RAY_ADDRESS) with RAY_AUTH_MODE
    unset and a token at hand uses token authentication, as Ray's documentation asks of drivers; a
    refused connection raises ConnectionError naming what to set."""
    target = address or os.environ.get("RAY_ADDRESS")
    joining = bool(target) and target != "local"
    if joining and "RAY_AUTH_MODE" not in os.environ and token_available():
        _use_token_auth()
    try:
        return ray.init(address=address, **options)
    except ConnectionError as error:
        if not joining:
            raise
        raise ConnectionError(
            f"could not join the Ray cluster at {target} ({error}). A head started with `ray start` asks "
            "for its authentication token: set RAY_AUTH_MODE=token and give the head's token as "
            "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (`ray get-auth-token` prints it on "
            f"the head); see {TOKEN_AUTH_DOCS}"
        ) from error


def _use_token_auth() -> None:
    """RAY_AUTH_MODE=token for this process and its children. Ray reads its settings once, at import: the
    function Ray runs when it turns token authentication on itself reads them again."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray: the variable alone, as its documentation asks
        os.environ["RAY_AUTH_MODE"] = "token"
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def state_api_address() -> str:
    """The address that points Ray's state API (`ray.util.state`) at the cluster this process is
    connected to. Without one the state API looks for a Ray instance on this machine and fails (or reads
    the wrong one) where several run: two simulated clusters, a test suite beside a `ray start`."""
    return ray.get_runtime_context().gcs_address
