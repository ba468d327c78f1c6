"""A driver joins a head started with `ray start`, which asks for its authentication token, with only
the steps the documentation gives (docs/guides/real-cluster.md): `ray start --head --num-gpus=4`,
RAY_ADDRESS set, the token where Ray keeps it (~/.ray/auth_token); the guide's own training script runs
against it. Ray's own driver does not use the token for an explicit address, and is refused until it
gives up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.doc_snippets import REPO_ROOT, page_script
from tests.helpers import free_port

GUIDE = REPO_ROOT / "docs" / "guides" / "real-cluster.md"


def wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the head's GCS did not listen on {port} within {timeout_s}s")


@pytest.fixture
def head(tmp_path):
    """A head of its own (own HOME, so its token, own temp dir and ports), stopped with its process group."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env["HOME"] = str(tmp_path)
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths live under it
    ray = Path(sys.executable).parent / "ray"
    # A machine that ran a local `ray.init()` holds a token; `ray start` then turns token authentication on.
    subprocess.run([str(ray), "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60)
    process = subprocess.Popen(
        [str(ray), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=4",
         "--include-dashboard=false", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(port, 60)
        yield env, port
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=5)  # `ray start --block` takes its time to stop; nothing of it is kept
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_the_guides_script_trains_on_a_ray_start_head_with_the_token_it_wrote(head, tmp_path):
    env, port = head
    assert (Path(env["HOME"]) / ".ray" / "auth_token").is_file()
    workdir = tmp_path / "work"
    workdir.mkdir()
    driver = subprocess.run([sys.executable, "-c", page_script(GUIDE)], cwd=workdir,
                            env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, capture_output=True, text=True,
                            timeout=300)
    assert driver.returncode == 0, driver.stdout[-2000:] + driver.stderr[-4000:]
    assert "InvalidAuthToken" not in driver.stderr

    # The README's next step on a real cluster is `baige-ray calibrate`. This head's GPUs are fake (no NVML
    # behind them), so the probed graph holds no accelerator: the command says so instead of measuring nothing.
    cli = Path(sys.executable).parent / "baige-ray"
    calibrated = subprocess.run([str(cli), "calibrate", "--json"], cwd=workdir, capture_output=True, text=True,
                                env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}",
                                     "BAIGE_RAY_CALIBRATION_DIR": str(tmp_path / "calibration")}, timeout=300)
    assert calibrated.returncode == 2 and "no accelerators" in calibrated.stderr, calibrated.stderr[-4000:]
    assert not (tmp_path / "calibration").exists()
