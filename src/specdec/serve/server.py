"""Running the app: a listening socket bound up front (so a busy port is one clear error), uvicorn on it,
in the foreground (``specdec serve``) or on a thread of its own (tests, ``specdec bench-serve``)."""

from __future__ import annotations

import socket
import threading
import time

from specdec.errors import InvalidArgumentError


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: any free port), or a one-line error."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def uvicorn_server(app, log_level: str = "warning"):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=5))


class BackgroundServer:
    """The app served by uvicorn on a thread, at ``url``, until ``stop`` (or the end of a ``with`` block)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.sock = listen(host, port)
        self.url = url_of(self.sock)
        self.server = uvicorn_server(app)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="specdec-http", daemon=True)

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
