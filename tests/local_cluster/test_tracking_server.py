"""The cluster path's tracking server, for real: MLflow's basic-auth app over PostgreSQL, artifacts
proxied into the server's artifacts destination, every socket on 127.0.0.1."""

from __future__ import annotations

import contextlib
import secrets

import psutil
import pytest
from mlflow.tracking import MlflowClient
from tracking_server import process_tree, tracking_server_fixture  # noqa: F401

from towerflow.local_cluster import ServerError, auth_header, start_tracking_server
from towerflow.local_cluster.processes import http_status

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def as_admin(tracking_server, monkeypatch):
    """This process as an MLflow client holding the admin's credentials."""
    for name, value in tracking_server.env.items():
        monkeypatch.setenv(name, value)
    return MlflowClient(tracking_server.uri)


def test_requests_without_valid_credentials_are_refused(tracking_server):
    experiments = f"{tracking_server.uri}/api/2.0/mlflow/experiments/search?max_results=1"
    assert http_status(experiments) == 401
    assert http_status(experiments, auth_header(tracking_server.username, "not-the-password")) == 401
    assert http_status(experiments, auth_header(tracking_server.username, tracking_server.password)) == 200


def test_checked_passwords_are_cached_and_a_password_changed_through_the_api_holds_at_once(
    tracking_server, as_admin
):
    """The server trusts a checked password for AUTH_CACHE_TTL_S instead of hashing it on every
    request: a hash changed behind its back (in the database) is not seen yet. A change made
    through MLflow's API is: the old password is refused on the next request."""
    from mlflow.server.auth.client import AuthServiceClient
    from werkzeug.security import generate_password_hash

    users = AuthServiceClient(tracking_server.uri)
    old, new = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    users.create_user("cached-user", old)
    experiments = f"{tracking_server.uri}/api/2.0/mlflow/experiments/search?max_results=1"
    assert http_status(experiments, auth_header("cached-user", old)) == 200

    with tracking_server.postgres.connect(tracking_server.database) as db:
        db.execute(
            "UPDATE users SET password_hash = %s WHERE username = %s",
            (generate_password_hash(new), "cached-user"),
        )
    assert http_status(experiments, auth_header("cached-user", old)) == 200  # from the cache

    users.update_user_password("cached-user", new)
    assert http_status(experiments, auth_header("cached-user", old)) == 401
    assert http_status(experiments, auth_header("cached-user", new)) == 200


def test_a_run_goes_to_postgres_and_its_artifact_through_the_proxy(tracking_server, as_admin, tmp_path):
    experiment = as_admin.create_experiment("proxied")
    run = as_admin.create_run(experiment)
    as_admin.log_metric(run.info.run_id, "loss", 0.25, step=3)
    (tmp_path / "note.txt").write_text("through the proxy")
    as_admin.log_artifact(run.info.run_id, str(tmp_path / "note.txt"), artifact_path="notes")
    as_admin.set_terminated(run.info.run_id)

    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    landed = list(tracking_server.server.artifacts_dir.rglob("note.txt"))
    assert [p.read_text() for p in landed] == ["through the proxy"]
    assert run.info.run_id in str(landed[0])
    assert [f.path for f in as_admin.list_artifacts(run.info.run_id, "notes")] == ["notes/note.txt"]

    with tracking_server.postgres.connect(tracking_server.database) as db:
        metrics = db.execute(
            "SELECT key, value, step FROM metrics WHERE run_uuid = %s", (run.info.run_id,)
        ).fetchall()
        status = db.execute("SELECT status FROM runs WHERE run_uuid = %s", (run.info.run_id,)).fetchone()
        admins = db.execute("SELECT username FROM users WHERE is_admin").fetchall()
    assert metrics == [("loss", 0.25, 3)]
    assert status == ("FINISHED",)
    assert admins == [(tracking_server.username,)]


def test_every_server_listens_on_loopback_only(tracking_server):
    for name, pid in (
        ("mlflow", tracking_server.server.process.pid),
        ("postgres", tracking_server.postgres.process.pid),
    ):
        listening = set()
        for process in process_tree(pid):
            # a short-lived child (a Postgres backend, a server worker) may end before it is read
            with contextlib.suppress(psutil.NoSuchProcess):
                listening |= {c.laddr for c in process.net_connections("inet") if c.status == "LISTEN"}
        assert listening, f"{name} listens nowhere"
        assert {address.ip for address in listening} == {"127.0.0.1"}, (name, listening)


def test_postgres_wants_the_password(tracking_server):
    import psycopg

    postgres = tracking_server.postgres
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(
            host=postgres.host, port=postgres.port, user=postgres.user, password="wrong", dbname="postgres"
        ).close()


def test_a_server_that_cannot_start_is_reported_with_its_log(tracking_server, tmp_path):
    with pytest.raises(ServerError) as failed:  # MLflow refuses an admin password under 12 characters
        start_tracking_server(
            tracking_server.postgres, tmp_path, username="admin", password="short", database="refused"
        )
    assert str(tmp_path / "mlflow-server.log") in str(failed.value)
    assert "at least 12 characters" in str(failed.value)
