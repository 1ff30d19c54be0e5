"""The OS sandbox one submission's grading process runs in: bubblewrap (`bwrap`), one per run.

What a sandboxed process gets (see docs/instructors.md for the threat model):

- its own PID, IPC, network, UTS and cgroup namespaces: it sees and can signal only its own
  processes, has no network, and everything it started (daemons, `start_new_session` included)
  is killed when its PID namespace's init exits (`--die-with-parent`: also when the batch dies);
- its own user id. As root, a fresh unprivileged host uid per run (`setpriv`: no capabilities,
  no_new_privs), so the process-count limit counts its processes alone and it can touch nothing
  of another run's; unprivileged, bwrap's user namespace (the uid is mapped to the instructor's);
- a filesystem of read-only system directories and Python environment, the read-only grading
  kit, the real model's converted preset when the instructor's cache holds it (read-only), its notebook (read-only), three result files bound one by one (nothing else is writable
  outside size-limited tmpfs: `/tmp`, `/dev/shm`, the working folder), and a fresh `/proc`.
  Nothing of the instructor's checkout, `solutions/`, the submissions or other runs is mounted;
- limits inherited from the parent: address space (counts shared-memory mappings, unlike
  RLIMIT_DATA), processes, file size (a sparse file cannot pass it either), CPU seconds, open files,
  no core dumps.
"""
from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`; Fedora: `sudo dnf install "
                "bubblewrap`; Arch: `pacman -S bubblewrap`)")
USERNS_HINT = ("bwrap needs user namespaces when not run as root: `sysctl kernel.unprivileged_userns_clone=1` "
               "(Debian < 11), `sysctl kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu >= 23.10), "
               "`sysctl user.max_user_namespaces=15000` (RHEL), or run the batch as root")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
KIT, WORK, OUT = "/grading/kit", "/grading/work", "/grading/out"
UID_BASE = 1_500_000_000  # fresh host uids for sandboxed runs as root: far above any real account


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create its namespaces here; the message says how to fix it."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed process tree."""

    memory_bytes: int  # RLIMIT_AS of each process
    cpu_seconds: int  # RLIMIT_CPU of each process
    processes: int = 64  # RLIMIT_NPROC (threads count): as root, of the run's own uid
    file_bytes: int = 256 << 20  # RLIMIT_FSIZE: the largest file it can write (results, tmpfs files)
    tmp_bytes: int = 256 << 20  # size of each tmpfs (/tmp, /dev/shm, the working folder)
    open_files: int = 1024


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def unavailable_reason() -> str | None:
    """None when a sandbox can be made here; else why not and how to fix it."""
    bwrap = bwrap_path()
    if bwrap is None:
        return f"the batch grader's sandbox needs bubblewrap (`bwrap`), which is not on PATH: {INSTALL_HINT}"
    missing = [tool for tool in ("prlimit", *(("setpriv",) if os.geteuid() == 0 else ())) if shutil.which(tool) is None]
    if missing:
        return f"the sandbox sets limits with `prlimit` and, as root, drops to a fresh uid with `setpriv` " \
               f"(util-linux): {missing} not on PATH"
    probe = [*_namespaces(), "--ro-bind", "/", "/", "--proc", "/proc", "--", "/bin/sh", "-c", "exit 0"]
    try:
        done = subprocess.run([bwrap, *probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not start a sandbox: {exc}"
    if done.returncode != 0:
        hint = USERNS_HINT if os.geteuid() != 0 else "check that the kernel allows new namespaces"
        return f"bwrap could not start a sandbox ({done.stderr.strip()[:300]}): {hint}"
    return None


def require() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise SandboxUnavailable(reason)


def _namespaces() -> list[str]:
    """bwrap's namespace options: as root without a user namespace (setpriv then drops to a fresh uid),
    unprivileged with one (and no further user namespaces inside)."""
    common = ["--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session"]
    if os.geteuid() == 0:
        return common
    return ["--unshare-user", "--disable-userns", *common]


def fresh_uid() -> int:
    """A host uid no account or earlier run uses (random, so concurrent batches do not share one)."""
    return UID_BASE + secrets.randbelow(500_000_000)


def python_dirs() -> list[str]:
    """What the interpreter and its packages need: the environment and its base installation."""
    found = []
    for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))):
        real = os.path.realpath(p)
        if not any(real == d or real.startswith(d.rstrip("/") + "/") for d in (*found, "/usr")):
            found.append(real)
    return found


def check_hidden(paths: list[Path]) -> None:
    """Refuses when a directory the sandbox mounts contains one it must not see (a checkout inside
    the Python environment's folder, say)."""
    for mounted in python_dirs():
        for hidden in paths:
            h = os.path.realpath(hidden)
            if h == mounted or h.startswith(mounted.rstrip("/") + "/"):
                raise SandboxUnavailable(f"the sandbox mounts the Python environment {mounted}, which contains "
                                         f"{h}: use a Python environment outside it")


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def command(argv: list[str], *, kit: Path, notebook: tuple[Path, str], outputs: dict[Path, str],
            env: dict[str, str], limits: Limits, shared: dict[Path, str] | None = None) -> list[str]:
    """The bwrap command line running `argv` in a sandbox (see the module docstring).

    `notebook`: (host file, name under WORK), read-only; `outputs`: host file -> name under OUT,
    each bound writable on its own (the run can write those files and nothing else on disk);
    `shared`: host folder -> absolute path inside, read-only (the real model's converted preset)."""
    args = [bwrap_path() or "bwrap", *_namespaces()]
    made: set[str] = set()

    def dirs_for(dest: str) -> None:
        for parent in _parents(dest):
            if parent not in made:
                made.add(parent)
                args.extend(["--perms", "0755", "--dir", parent])

    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args.extend(["--symlink", os.readlink(d), d])
        elif os.path.isdir(d):
            args.extend(["--ro-bind", d, d])
    # the private /tmp and /dev/shm first: a Python environment under /tmp (a checkout there) is bound
    # over them below instead of being hidden by them
    args.extend(["--dev", "/dev",
                 "--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
                 "--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"])
    made.update({"/tmp", "/dev", "/dev/shm"})
    for f in SYSTEM_FILES:
        if os.path.exists(f):
            dirs_for(f)
            args.extend(["--ro-bind", f, f])
    for d in python_dirs():
        dirs_for(d + "/x")
        args.extend(["--ro-bind", d, d])
    for host, inside in (shared or {}).items():
        for parent in _parents(inside + "/x"):  # writable by the run's uid, as /tmp: a cache writes beside it
            if parent not in made:
                made.add(parent)
                args.extend(["--perms", "1777", "--dir", parent])
        args.extend(["--ro-bind", str(host), inside])
    dirs_for(KIT + "/x")
    args.extend(["--ro-bind", str(kit), KIT])
    args.extend(["--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", WORK])
    args.extend(["--ro-bind", str(notebook[0]), f"{WORK}/{notebook[1]}"])
    args.extend(["--perms", "0755", "--dir", OUT])
    for host, name in outputs.items():
        args.extend(["--bind", str(host), f"{OUT}/{name}"])
    args.extend(["--proc", "/proc", "--remount-ro", "/", "--chdir", WORK, "--clearenv"])
    for key, value in env.items():
        args.extend(["--setenv", key, value])
    args.append("--")
    return args + argv


def drop_to(uid: int) -> list[str]:
    """As root: the prefix that runs the command as `uid` without capabilities or a way back."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"]


def _own_process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                continue
    return count


def limited(limits: Limits) -> list[str]:
    """The `prlimit` prefix that sets the limits before bwrap starts (everything in the sandbox inherits
    them). Unprivileged, the process count is that of the instructor's uid: the ones running are added."""
    extra = 0 if os.geteuid() == 0 else _own_process_count()
    return ["prlimit", f"--as={limits.memory_bytes}", f"--cpu={limits.cpu_seconds}",
            f"--nproc={limits.processes + extra}", f"--fsize={limits.file_bytes}", f"--nofile={limits.open_files}",
            "--core=0", "--"]


def processes_of(uids: set[int]) -> list[int]:
    """Host pids of processes owned by any of `uids` (a sandbox's leftovers; [] when all are gone)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
