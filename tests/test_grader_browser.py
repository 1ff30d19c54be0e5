"""nbgrader's JupyterLab extension really loads in the pinned JupyterLab: the server `make lab`
starts (JupyterLab on labs/) serves it, and headless Chromium shows the Validate button and the
assignment list. Skips where /usr/bin/chromium (Debian package `chromium`) is absent."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from grader.labs import REPO_ROOT

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@pytest.fixture(scope="module")
def lab_url(tmp_path_factory):
    """JupyterLab as `make lab` starts it, on a scratch copy of labs/; yields (base url, token)."""
    root = tmp_path_factory.mktemp("labs")
    shutil.copytree(REPO_ROOT / "labs" / "00_warmup", root / "00_warmup")
    port, token = free_port(), secrets.token_hex(16)
    args = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", f"--ServerApp.root_dir={root}",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", f"--IdentityProvider.token={token}"]
    if os.geteuid() == 0:
        args.append("--allow-root")
    log = open(root / "server.log", "w")
    server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            get(f"{base}/api/status?token={token}")
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start:\n{(root / 'server.log').read_text()}")
            time.sleep(0.5)
    yield base, token
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


def test_the_server_loads_nbgrader_server_and_lab_extensions(lab_url):
    base, token = lab_url
    page = get(f"{base}/lab?token={token}")
    config = json.loads(page.split('<script id="jupyter-config-data" type="application/json">', 1)[1].split("</script>", 1)[0])
    assert "@jupyter/nbgrader" in [ext["name"] for ext in config["federated_extensions"]]
    import nbgrader

    # the assignment_list server extension answers, and agrees with the lab extension's version
    version = json.loads(get(f"{base}/nbgrader_version?version={nbgrader.__version__}&token={token}"))
    assert version["success"] is True, version


def test_chromium_shows_the_validate_button_and_the_assignment_list(lab_url):
    if not CHROMIUM.exists():
        pytest.skip(f"needs {CHROMIUM} (Debian: apt-get install -y chromium); CI machines lack it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pinned in pyproject)")
    base, token = lab_url
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(f"{base}/lab/tree/00_warmup/00_warmup.ipynb?token={token}")
            validate = page.locator(".validate-button").first
            validate.wait_for(state="visible", timeout=90_000)
            assert "Validate" in validate.inner_text()
            page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").click()
            page.locator(".lm-Menu-itemLabel", has_text="Assignment List").click()
            page.get_by_text("Released assignments").first.wait_for(state="visible", timeout=30_000)
        finally:
            browser.close()
