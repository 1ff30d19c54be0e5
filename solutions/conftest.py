"""`pytest <this folder>/NN_name` grades that folder's notebook with the lab's official tests
(grader/labtests/labNN_name.py) and ends with points per task: see grader/plugin.py."""
from grader.plugin import *  # noqa: F401,F403 - the hooks and the `student` fixture
