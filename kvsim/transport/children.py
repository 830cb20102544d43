"""Child processes of a transfer run (a decode host, a sender, a benchmark peer): started so
that they end with the process that started them, however it ends, and stopped in order.

`popen` starts a child that gets SIGTERM when its parent dies (SIGKILL included), on Linux
through prctl(PR_SET_PDEATHSIG). The prctl runs in a few lines of Python exec'd first in
the child (`_SHIM`), which then execs the real command in the same process (same pid):

- not `preexec_fn`: Python code between fork and exec can deadlock when the parent has
  other threads (ZeroMQ I/O threads, torch's pools), and it forces fork() where CPython
  otherwise uses vfork(), which matters for a parent holding GBs of tensors;
- not `process_group` / `start_new_session`: a new group changes who gets the terminal's
  Ctrl-C, and nothing in it follows the parent's death;
- the death signal survives execve (unless the new image is set-uid/set-gid or has file
  capabilities), so it survives `ip netns exec NS cmd`, which switches namespace and execs
  cmd in the same process (iproute2 forks only in batch mode);
- the parent may die before prctl runs (the child is then reparented and no signal will
  come): the shim compares os.getppid() with the parent's pid after prctl and exits if it
  differs.

The signal is sent when the *thread* that forked the child exits, not the process: call
`popen` from a thread that outlives the child (every caller here uses the main thread).
Elsewhere (not Linux) `popen` is plain subprocess.Popen.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

# argv: PARENT_PID PATH ARGV0 ARGS...; stdlib only (it runs with -I -S)
_SHIM = """\
import ctypes, os, signal, sys
parent, path, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
if libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM),
              ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
if os.getppid() != parent:  # the parent died before prctl: no signal will come
    os._exit(128 + signal.SIGTERM)
for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; an ignore survives exec
    signal.signal(sig, signal.SIG_DFL)
os.execv(path, argv)
"""


def _shim_argv(argv: list[str], parent_pid: int, env: dict | None) -> list[str]:
    """argv that runs `argv` (PATH lookup as subprocess does) after the shim's prctl."""
    path = argv[0]
    if os.sep not in path:
        found = shutil.which(path, path=os.pathsep.join(os.get_exec_path(env)))
        if found is None:  # the error Popen raises, in the parent rather than the child
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        path = found
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(parent_pid), path, *argv]


def popen(argv: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **kwargs) for a child that gets SIGTERM when this process (the
    calling thread) dies. `argv` is a list; no shell=, executable= or preexec_fn=."""
    if not argv or isinstance(argv, str | bytes):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    if {"shell", "executable", "preexec_fn"} & kwargs.keys():
        raise TypeError("popen takes no shell=, executable= or preexec_fn=")
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(argv, **kwargs)
    shimmed = _shim_argv([os.fspath(a) for a in argv], os.getpid(), kwargs.get("env"))
    return subprocess.Popen(shimmed, **kwargs)


def stop(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """End a child that is still running: SIGTERM, then SIGKILL after `grace_s`."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)
