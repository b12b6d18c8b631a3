"""An app served by uvicorn in a thread on a free loopback port: what the serving benchmark and the tests run the
server in, beside the client that calls it."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from roads_to_rome.serving.connections import uvicorn_config


class BackgroundServer:
    """Serves `app` while the `with` block runs; `url` is where."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn_config(app, host, port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        for _ in range(200):
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
