"""`make lab`: the learner's JupyterLab. nbgrader's Validate button stays; the instructor's tools
(Formgrader, Create Assignment) and the exchange-based Assignment and Course lists are off: a learner
works in their own clone and grades with Validate, the notebook's check cells or `pytest labs/NN_name`."""
from pathlib import Path

c = get_config()  # noqa: F821 - injected by traitlets
load_subconfig(str(Path(__file__).resolve().parent.parent / "lab_config.py"))  # noqa: F821
c.ServerApp.jpserver_extensions = {
    "nbgrader.server_extensions.formgrader": False,
    "nbgrader.server_extensions.assignment_list": False,
    "nbgrader.server_extensions.course_list": False,
    "nbgrader.server_extensions.validate_assignment": True,
}
