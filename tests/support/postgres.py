"""A throwaway PostgreSQL server on loopback for tests: initdb in a temp dir, pg_ctl start/stop.

PostgreSQL refuses to run as root, so under root it runs as the ``postgres`` user (Debian's
package creates it). A missing installation is a test failure with the fix in its message,
never a skip: ``tools/setup.sh`` and ``.ci/run`` install the package.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

INSTALL_HINT = (
    "PostgreSQL is not installed: `apt-get install -y postgresql` "
    "(tools/setup.sh and .ci/run do this)"
)


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    if not found[-1]:
        raise AssertionError(INSTALL_HINT)
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    def __init__(self) -> None:
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="mlxcel-pg-"))
        self.data = self.dir / "data"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            self._as_user = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.dir, "postgres")
        self._run(_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self.start()
        self._run(
            _bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
            "-c", "CREATE DATABASE mlxcel",
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/mlxcel"

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(
            [*self._as_user, *cmd], capture_output=True, text=True, timeout=60, cwd=self.dir
        )
        if done.returncode:
            raise AssertionError(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")

    def start(self) -> None:
        opts = f"-h 127.0.0.1 -p {self.port} -k {self.dir} -F"  # -F: no fsync, a test database
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"),
                  "-w", "start")  # fmt: skip

    def stop(self) -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
