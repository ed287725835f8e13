"""The local cluster's secrets: from the environment when the user set them, else generated once
into the state directory (files readable by their owner only) and reused by every later `up`.

A secret the user passed in the environment is never written anywhere; the state directory is
outside the repository by default, so a job's working directory never ships a generated one.
"""

from __future__ import annotations

import os
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path

RAY_TOKEN_VAR = "RAY_AUTH_TOKEN"
MLFLOW_USERNAME_VAR = "MLFLOW_TRACKING_USERNAME"
MLFLOW_PASSWORD_VAR = "MLFLOW_TRACKING_PASSWORD"
DEFAULT_MLFLOW_USERNAME = "admin"
MIN_MLFLOW_PASSWORD = 12  # MLflow's basic-auth refuses a shorter admin password


@dataclass(frozen=True)
class Secret:
    """A secret's value and where it came from: `file` is None when it came from the environment."""

    value: str = field(repr=False)
    variable: str
    file: Path | None = None

    def export_line(self) -> str:
        """A shell line that sets `variable` without spelling out the value."""
        if self.file is None:
            return f"# {self.variable}: keep the value this cluster was started with (from your environment)"
        return f'export {self.variable}="$(cat {shlex.quote(str(self.file))})"'


def ray_token(state_dir: Path) -> Secret:
    """Ray's token: RAY_AUTH_TOKEN, else state_dir/ray_auth_token."""
    return _from_env_or_file(RAY_TOKEN_VAR, Path(state_dir) / "ray_auth_token", lambda: secrets.token_hex(32))


def mlflow_admin(state_dir: Path) -> tuple[str, Secret]:
    """The tracking server's admin: (MLFLOW_TRACKING_USERNAME or 'admin', MLFLOW_TRACKING_PASSWORD,
    else state_dir/mlflow_password)."""
    username = os.environ.get(MLFLOW_USERNAME_VAR) or DEFAULT_MLFLOW_USERNAME
    password = _from_env_or_file(
        MLFLOW_PASSWORD_VAR, Path(state_dir) / "mlflow_password", lambda: secrets.token_urlsafe(24)
    )
    if len(password.value) < MIN_MLFLOW_PASSWORD:
        from towerflow.errors import TowerflowError

        raise TowerflowError(
            f"{MLFLOW_PASSWORD_VAR} is shorter than {MIN_MLFLOW_PASSWORD} characters, which MLflow's "
            "basic-auth refuses for its admin; set a longer one, or unset it to have one generated"
        )
    return username, password


def postgres_password(state_dir: Path) -> Secret:
    """The database superuser's password: the servers' own business, always generated."""
    return _from_env_or_file(
        "PGPASSWORD", Path(state_dir) / "postgres_password", lambda: secrets.token_hex(24), env=False
    )


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, readable and writable by its owner only (from the moment it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)
    return path


def _from_env_or_file(variable: str, path: Path, generate, env: bool = True) -> Secret:
    if env and os.environ.get(variable):
        return Secret(os.environ[variable], variable)
    if path.exists():
        return Secret(path.read_text().strip(), variable, path)
    write_private(path, generate() + "\n")
    return Secret(path.read_text().strip(), variable, path)
