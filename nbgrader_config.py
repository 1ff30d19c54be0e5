"""nbgrader course set-up: `solutions/` is the source, `labs/` the release (docs/instructors.md)."""
from pathlib import Path

c = get_config()  # noqa: F821 - nbgrader injects get_config

ROOT = Path(__file__).resolve().parent
c.CourseDirectory.root = str(ROOT)
c.CourseDirectory.course_id = "inference-labs"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"  # release path is labs/./NN_name: flat
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
# Only the notebook is released: the official tests stay in grader/labtests.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "conftest.py", "feedback", ".pytest_cache"]

# The stub nbgrader leaves in a solution region: graded tests must fail on it.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}

# Cell time limit while autograding (seconds); a cell past it fails, the rest still runs.
c.Execute.timeout = 120
c.Execute.interrupt_on_timeout = True

# The exchange (release/fetch/submit between instructor and learners on one machine) is a folder in the
# course, created by `make instructor`; nbgrader's default, /srv/nbgrader/exchange, needs root to create.
c.Exchange.root = str(ROOT / ".exchange")
