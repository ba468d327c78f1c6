"""A worker's death as the operating system reports it: each worker holds one TCP connection to the
controller, and the kernel closes it the moment the worker's process ends (SIGKILL, a crash, the OOM
killer), on whatever node it ran.

Ray tells the controller too, through its actor-death notice, but that notice took up to 3 s to fail a
step in flight on a loaded 2-core machine, and a heartbeat to the dead actor no less; a closed socket
is seen in milliseconds. A node that stops answering closes nothing: heartbeats still find that.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
NAME_LIMIT = 512  # bytes: a worker name, then the connection stays silent


class LivenessListener:
    """The controller's end: accepts one connection per worker and notes when each one closes."""

    def __init__(self, host: str):
        self._server = socket.create_server((host, 0))
        self._server.setblocking(False)
        self.address = (host, self._server.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, data=None)
        self._names: dict[socket.socket, bytes] = {}
        self._closed: dict[str, float] = {}  # worker name -> when its connection closed (monotonic)
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="baige-liveness", daemon=True)
        self._thread.start()

    def exited(self, names: list[str]) -> dict[str, float]:
        """Of `names`, those whose process has exited, with when its connection closed."""
        with self._lock:
            return {name: self._closed[name] for name in names if name in self._closed}

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=1.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    def _serve(self) -> None:
        while self._running:
            for key, _ in self._selector.select(timeout=0.1):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.fileobj)

    def _accept(self) -> None:
        try:
            connection, _ = self._server.accept()
        except OSError:
            return
        connection.setblocking(False)
        self._names[connection] = b""
        self._selector.register(connection, selectors.EVENT_READ, data="worker")

    def _read(self, connection: socket.socket) -> None:
        try:
            chunk = connection.recv(NAME_LIMIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the kernel of a process that died
            chunk = b""
        if chunk and len(self._names[connection]) < NAME_LIMIT:
            self._names[connection] += chunk
            return
        if chunk:
            return  # more than a name: ignored
        name = self._names.pop(connection).split(b"\n", 1)[0].decode(errors="replace")
        self._selector.unregister(connection)
        connection.close()
        if name:
            with self._lock:
                self._closed[name] = time.monotonic()


class LivenessConnection:
    """A worker's end: opened once, then held until the process ends (the kernel closes it then)."""

    def __init__(self) -> None:
        self._socket: socket.socket | None = None

    def connect(self, address: tuple[str, int], name: str) -> bool:
        """Connect to the controller at `address` as `name` (a reconnect to a restarted controller
        replaces the old connection). False where it cannot: heartbeats still watch this worker."""
        try:
            connection = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
            connection.sendall(name.encode() + b"\n")
        except OSError as error:
            logger.warning("no liveness connection to the controller at %s: %s", address, error)
            return False
        previous, self._socket = self._socket, connection
        if previous is not None:
            previous.close()
        return True
