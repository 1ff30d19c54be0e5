"""JupyterLab settings shared by `make lab` (learner) and `make instructor`: no news fetch and no update
check (nothing may reach the network; the news prompt itself is switched off in each mode's
labconfig/page_config.json, which disables the announcements plugin), and terminals that start in the repository root with the
project's virtual environment first on PATH, so `pytest labs/NN_name` works there.

Loaded by jupyter/{learner,instructor}/jupyter_server_config.py (JUPYTER_CONFIG_PATH points there).
"""
from pathlib import Path

c = get_config()  # noqa: F821 - injected by traitlets

REPO = Path(__file__).resolve().parent.parent
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
# A login shell (what terminals run by default) re-reads /etc/profile, which drops .venv/bin from PATH.
c.ServerApp.terminado_settings = {"shell_command": ["bash", "--rcfile", str(REPO / "jupyter" / "terminal.bashrc"), "-i"]}
