"""A worker's death as its closed connection tells it (elastic/liveness.py): a process SIGKILLed is seen
exited at once, a live one is not, and only the named workers are reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from baige_ray.elastic.liveness import LivenessConnection, LivenessListener

HOLDER = """
import sys, time
from baige_ray.elastic.liveness import LivenessConnection
held = LivenessConnection()
assert held.connect((sys.argv[1], int(sys.argv[2])), sys.argv[3])
print("connected", flush=True)
time.sleep(60)
"""


def _wait_until(condition, timeout_s: float = 5.0) -> float:
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout_s, "not seen in time"
        time.sleep(0.005)
    return time.monotonic() - began


def test_a_sigkilled_worker_is_seen_exited_at_once_and_a_live_one_is_not():
    listener = LivenessListener("127.0.0.1")
    try:
        holders = {name: subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, listener.address), name],
                                          stdout=subprocess.PIPE, text=True) for name in ("w0", "w1")}
        for holder in holders.values():
            assert holder.stdout.readline().strip() == "connected"
        time.sleep(0.1)
        assert listener.exited(["w0", "w1"]) == {}
        os.kill(holders["w1"].pid, signal.SIGKILL)
        seen_after = _wait_until(lambda: "w1" in listener.exited(["w0", "w1"]))
        # Milliseconds when idle; the bound leaves room for a unit tier that keeps both cores busy.
        assert seen_after < 2.0 and list(listener.exited(["w0", "w1"])) == ["w1"]
        assert listener.exited(["w0"]) == {}
    finally:
        for holder in holders.values():
            holder.kill()
            holder.wait()
        listener.close()


def test_a_reconnect_replaces_the_old_connection_and_a_close_is_an_exit():
    listener = LivenessListener("127.0.0.1")
    try:
        held = LivenessConnection()
        assert held.connect(listener.address, "w0") and held.connect(listener.address, "w0-again")
        _wait_until(lambda: "w0" in listener.exited(["w0"]))  # the first connection, closed by the second
        assert listener.exited(["w0-again"]) == {}
        held._socket.close()
        _wait_until(lambda: "w0-again" in listener.exited(["w0-again"]))
    finally:
        listener.close()


def test_no_listener_leaves_the_worker_to_heartbeats():
    listener = LivenessListener("127.0.0.1")
    address = listener.address
    listener.close()
    assert LivenessConnection().connect(address, "w0") is False
