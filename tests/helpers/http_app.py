"""An ASGI app served on a thread of the test process, and a free local port for it."""

from __future__ import annotations

import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen(app, port: int):
    """Serve ``app`` with uvicorn on a thread; returns the function that stops it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(10)

    return stop
