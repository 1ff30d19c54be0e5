"""`make instructor`: JupyterLab on the course root with all of nbgrader (Formgrader, Create Assignment,
Assignment and Course lists against the local exchange folder nbgrader_config.py names)."""
from pathlib import Path

c = get_config()  # noqa: F821 - injected by traitlets
load_subconfig(str(Path(__file__).resolve().parent.parent / "lab_config.py"))  # noqa: F821
