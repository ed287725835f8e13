"""`towerflow ui` for real: the MLflow server over the run store, the run page in headless Chromium.

Chromium and its driver come from Debian (`chromium`, `chromium-driver`); the test installs them
when missing and is skipped only when that is impossible here, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import ray
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from support import free_ports, takes_ctrl_c
from tracking_server import still_running

from towerflow.tracking.store import without_credentials
from towerflow.tracking.system_metrics import node_labels
from towerflow.tracking.ui import run_page_url


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def chromium() -> tuple[str, str]:
    """(browser, driver) paths; installs Debian's chromium + chromium-driver when they are missing."""
    found = _chromium()
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("no Chromium here and no way to install it (needs apt-get as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    why = ""
    for command in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
    ):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            why = f"{' '.join(command)} timed out"
            break
        if done.returncode != 0:
            why = f"{' '.join(command)} failed: {done.stderr.strip()[-300:]}"
            break
    found = _chromium()
    if not found:
        pytest.skip(
            f"no Chromium could be installed ({why or 'chromium/chromedriver not on PATH after install'})"
        )
    return found


@pytest.fixture
def browser(chromium):
    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,2400",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)  # no driver download
    yield driver
    driver.quit()


def _page_text_when(driver, ready, timeout_s: float = 90) -> str:
    """The page's text once `ready(text)` holds (the UI is a React app that renders after fetching)."""
    body = lambda d: d.find_element(By.TAG_NAME, "body").text  # noqa: E731
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.5).until(lambda d: ready(body(d)))
    except Exception:
        pytest.fail(f"the run page never showed what the test waits for; it shows:\n{body(driver)[:5000]}")
    return body(driver)


def _logged_models(text: str) -> int:
    found = re.search(r"Logged models \((\d+)\)", text)
    return int(found.group(1)) if found else 0


def _listening(port: int) -> list[str]:
    return [
        c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port
    ]


@pytest.mark.slow
def test_towerflow_ui_serves_the_run_page_on_loopback_until_ctrl_c(exported_run, browser):
    # As a user does it: start `towerflow ui`, open the run in a browser, press Ctrl-C.
    _, uri, result = exported_run
    port = free_ports()[0]
    command = [sys.executable, "-m", "towerflow", "ui", "--port", str(port), "--store", uri]
    cli = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=takes_ctrl_c
    )
    try:
        line = cli.stdout.readline()  # printed once the server answers
        assert f"at http://127.0.0.1:{port}" in line, line
        assert set(_listening(port)) == {"127.0.0.1"}
        _shows_the_run(browser, f"http://127.0.0.1:{port}", uri, result.run_id)
    finally:
        _stop(cli, signal.SIGINT)
    assert cli.returncode == 130
    deadline = time.monotonic() + 10  # Ctrl-C stops the server too
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _listening(port) == []


def test_a_sigterm_stops_the_ui_and_its_server_which_has_no_store_on_its_command_line(tmp_path):
    """`kill` (or a supervisor's stop) ends `towerflow ui` as Ctrl-C does, its server with it (it
    kept the port before); the store's address, a database's password perhaps, is not on any
    process's command line, where `ps` shows it to every user."""
    port = free_ports()[0]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [sys.executable, "-m", "towerflow", "ui", "--port", str(port), "--store", store]
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = cli.stdout.readline()  # printed once the server answers
        assert f"at http://127.0.0.1:{port}" in line, line
        servers = psutil.Process(cli.pid).children(recursive=True)
        assert servers and not any(store in " ".join(p.cmdline()) for p in servers)
    finally:
        _stop(cli, signal.SIGTERM)
    assert cli.returncode == 143
    deadline = time.monotonic() + 10  # its processes end with it (zombies are ended)
    while (still_running(servers) or _listening(port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert still_running(servers) == [] and _listening(port) == []


def _stop(cli: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the command and wait for it to exit (killed, and failing, after 30 s)."""
    cli.send_signal(signum)
    try:
        cli.wait(30)
    except subprocess.TimeoutExpired:
        cli.kill()
        raise


def _shows_the_run(browser, base_url: str, uri: str, run_id: str) -> None:
    """The run page shows the run's metrics, its logged model and each Ray node's host metrics."""
    from mlflow.tracking import MlflowClient

    experiment_id = MlflowClient(uri).get_run(run_id).info.experiment_id
    browser.get(run_page_url(base_url, experiment_id, run_id))  # the address `towerflow train` prints
    metrics = ["loss", "examples_per_sec", "time_compute_s", "train_accuracy"]
    # the exported model: the one of the run's end at least (test_export may have added another)
    text = _page_text_when(
        browser, lambda t: all(m in t for m in metrics) and "blobs-mlp" in t and _logged_models(t) >= 1
    )
    assert run_id in text and "Finished" in text
    # each Ray node's host metrics, under MLflow's own System metrics tab
    browser.find_element(By.XPATH, "//*[normalize-space(text())='System metrics']").click()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    # the tab groups its charts per node: a "system/<node> (<chart count>)" header, then the charts
    headers = [re.compile(rf"system/{re.escape(label)}\s*\(\d+\)") for label in node_labels(nodes).values()]
    _page_text_when(
        browser, lambda t: all(h.search(t) for h in headers) and "cpu_utilization_percentage" in t
    )


def test_a_taken_port_is_refused_before_mlflow_starts(tmp_path):
    # Another server on the port (an MLflow UI over another store, often) would answer our health
    # check; the command must say the port is taken instead of pointing the user at that server.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "towerflow",
                "ui",
                "--port",
                str(port),
                "--store",
                f"sqlite:///{tmp_path / 'm.db'}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert not (tmp_path / "m.db").exists()  # MLflow never started


def test_a_tracking_server_store_is_sent_to_its_own_ui():
    # A tracking server serves its own UI; `mlflow server` over an http store would fail obscurely.
    # The message names the server without the credentials its address may carry.
    out = subprocess.run(
        [sys.executable, "-m", "towerflow", "ui", "--store", "https://alice:s3cret@mlflow.example:8443/"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "the store https://mlflow.example:8443 is a tracking server: open it in a browser" in out.stderr
    assert "s3cret" not in out.stderr + out.stdout


def test_a_run_page_address_keeps_no_credentials():
    page = run_page_url("http://bob:pw@10.0.0.5:5000/?x=1", "7", "abc")
    assert page == "http://10.0.0.5:5000/#/experiments/7/runs/abc"
    # what goes into a run's error tag and the logs
    said = without_credentials("postgresql://u:s3cret@db:5432/mlflow refused; https://a:b@h/x too")
    assert said == "postgresql://db:5432/mlflow refused; https://h/x too"
