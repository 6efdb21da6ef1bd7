"""Run model-generated code (HumanEval completions and their tests) in a throw-away sandbox.

This is the only place lmforge executes code a model wrote. Layers (standard library and Linux
only; no preexec_fn, so the caller may be multi-threaded):

* a fresh launcher process (`python -I -B sandbox.py --child OPTS`, the program on stdin);
* new mount, network, IPC and pid namespaces (`unshare` through ctypes; as non-root also a user
  namespace mapping our uid to 65534): pid 1 of the new pid namespace re-binds every mount
  read-only, mounts a small private tmpfs over an empty temporary directory (the only writable
  place) and a fresh /proc, then runs the program as pid 2 with rlimits (CPU time, address
  space, file size, processes, open files, no core) as uid 65534 with no capabilities and
  PR_SET_NO_NEW_PRIVS; the network namespace has no interface up, so connect() fails even to
  127.0.0.1; when pid 1 exits the kernel kills everything left in the namespace;
* a wall-clock timeout in the parent, then SIGKILL of the launcher's group and a sweep of every
  process still in the sandbox's pid namespace.

RLIMIT_NPROC is ignored by the kernel for kuid 0, hence the drop to uid 65534 in root mode (a
fork bomb reached 8,000 processes without it). Where namespaces cannot be created (no root and
no unprivileged user namespaces), nothing runs: the result is status `no_sandbox` and the
sample scores 0 -- a Python-level guard is not a sandbox.

Why by hand: no maintained Python package isolates a subprocess this way; bubblewrap or nsjail
would, but they are system packages the pipeline cannot assume, and lm-eval's own `code_eval`
runs code in-process with a Python-level guard (and needs the hub).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x10000000, 0x40000000, 0x08000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_TO_MS = {
    1: MS_RDONLY,
    2: MS_NOSUID,
    4: MS_NODEV,
    8: MS_NOEXEC,
    1024: MS_NOATIME,
    2048: MS_NODIRATIME,
    4096: MS_RELATIME,
}
PR_SET_NO_NEW_PRIVS = 38
SANDBOX_UID = 65534  # "nobody" inside the namespace


@dataclass
class Result:
    passed: bool
    status: str  # passed | failed | timeout | killed:<signal> | error
    returncode: int | None
    isolation: str  # namespaces:root | namespaces:userns | unknown (setup failed, nothing ran)
    seconds: float
    stdout: str
    stderr: str


# ----------------------------------------------------------------------------- child side
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _enter_namespaces() -> str:
    """New mount/net/ipc/pid namespaces. Returns the mode:

    root   - we are root: plain namespaces; the program later drops to SANDBOX_UID with setuid().
             (A user namespace mapping to host uid 0 would leave the program as kuid 0, for which
             the kernel ignores RLIMIT_NPROC: a fork bomb reached 8,000+ processes that way.)
    userns - unprivileged: a user namespace mapping our own uid to SANDBOX_UID inside; RLIMIT_NPROC
             then counts our (non-root) kuid.
    """
    libc = _libc()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID
    if os.geteuid() == 0:
        _check(libc.unshare(flags), "unshare")
        return "root"
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(CLONE_NEWUSER | flags), "unshare")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{SANDBOX_UID} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{SANDBOX_UID} {gid} 1")
    return "userns"


PY_MOUNT = ".python"  # root mode: the interpreter's prefix, bind-mounted read-only into the work dir


def _setup_mounts(workdir: str, tmpfs_mb: int, bind_python: bool) -> None:
    """Runs as pid 1 of the new pid namespace (still holding the user namespace's capabilities)."""
    libc = _libc()
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make-private")
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mounts.append(line.split()[4].encode().decode("unicode_escape"))
    for mp in mounts:  # read-only bind remount of every mount, keeping its locked flags
        try:
            st = os.statvfs(mp)
        except OSError:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for st_bit, ms_bit in ST_TO_MS.items():
            if st.f_flag & st_bit:
                flags |= ms_bit
        libc.mount(None, mp.encode(), None, flags, None)  # failures (e.g. hidden mounts) are checked below
    opts = f"size={tmpfs_mb}m,mode=0777,nr_inodes=4096".encode()
    # the only writable place: a private tmpfs mounted over the (empty) host work dir
    _check(libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), "tmpfs workdir")
    if bind_python:  # the sandbox uid may not traverse the prefix's parents (e.g. pyenv under /root, mode 700)
        target = os.path.join(workdir, PY_MOUNT)
        os.mkdir(target)
        _check(libc.mount(sys.base_prefix.encode(), target.encode(), None, MS_BIND | MS_REC, None), "bind python")
        _check(
            libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
            "ro python",
        )
    # a /proc that shows only the sandbox's own processes
    _check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "proc")
    for mp in mounts:  # verify: no other mount may stay writable
        if mp.startswith(("/proc", "/sys")):
            continue
        try:
            if not os.statvfs(mp).f_flag & 1:
                raise OSError(f"mount {mp} is still writable")
        except FileNotFoundError:
            pass


def _wait_status(pid: int) -> int:
    """Exit code to hand upwards: the child's code, or 128+signal."""
    _, st = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st)


def _exec_program(opts: dict, isolation: str, drop_to_uid: int | None = None) -> None:
    lim = opts["limits"]
    workdir = opts["workdir"]
    os.chdir(workdir)
    print(json.dumps({"isolation": isolation}), file=sys.stderr, flush=True)
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["as_mb"] << 20, lim["as_mb"] << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["fsize_mb"] << 20, lim["fsize_mb"] << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if drop_to_uid is not None:  # root mode: lose root (and every capability) before running the program
        os.setgroups([])
        os.setgid(drop_to_uid)
        os.setuid(drop_to_uid)
    _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    exe = sys.executable
    if drop_to_uid is not None:  # run the base interpreter through the read-only bind mount (stdlib only)
        prefix = os.path.join(workdir, PY_MOUNT)
        real = os.path.realpath(sys.executable)
        rel = (
            os.path.relpath(real, os.path.realpath(sys.base_prefix))
            if real.startswith(os.path.realpath(sys.base_prefix) + os.sep)
            else os.path.join("bin", os.path.basename(real))
        )
        exe = os.path.join(prefix, rel)
        env["LD_LIBRARY_PATH"] = os.path.join(prefix, "lib")  # pyenv builds carry an absolute RUNPATH
    os.execve(exe, [exe, "-I", "-B", "prog.py"], env)


def child_main(opts: dict) -> None:
    prog = sys.stdin.read()
    try:
        mode = _enter_namespaces()
    except OSError as e:
        print(f"sandbox: namespaces unavailable: {e}", file=sys.stderr)
        os._exit(97)
    pid1 = os.fork()
    if pid1 == 0:  # pid 1 of the new pid namespace: mounts, then run the program as pid 2
        try:
            _setup_mounts(opts["workdir"], opts["tmpfs_mb"], bind_python=mode == "root")
            with open(os.path.join(opts["workdir"], "prog.py"), "w") as f:
                f.write(prog)
            pid2 = os.fork()
            if pid2 == 0:
                _exec_program(opts, f"namespaces:{mode}", SANDBOX_UID if mode == "root" else None)
            os._exit(_wait_status(pid2))  # pid 1 exiting kills everything left in the namespace
        except BaseException as e:  # noqa: BLE001
            print(f"sandbox: setup failed: {e!r}", file=sys.stderr, flush=True)
            os._exit(98)
    os._exit(_wait_status(pid1))


# ----------------------------------------------------------------------------- parent side
def _ns_link(pid: int, name: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{name}")
    except OSError:
        return None


def _kill_namespace(ns: str | None, pgid: int) -> None:
    """SIGKILL the launcher's process group, then everything inside the sandbox's pid namespace
    (killing its pid 1 already makes the kernel kill the rest; the sweep is belt and braces)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    if not ns or ns == _ns_link(os.getpid(), "pid"):
        return
    for _ in range(50):
        victims = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ns_link(int(p), "pid") == ns]
        if not victims:
            return
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)


def run_program(
    code: str,
    timeout: float = 10.0,
    cpu_s: int = 10,
    as_mb: int = 1024,
    fsize_mb: int = 16,
    nproc: int = 32,
    nofile: int = 64,
    tmpfs_mb: int = 64,
    max_output: int = 4096,
) -> Result:
    """Run `code` sandboxed; never raises for anything the code does."""
    opts = {
        "limits": {"cpu_s": cpu_s, "as_mb": as_mb, "fsize_mb": fsize_mb, "nproc": nproc, "nofile": nofile},
        "tmpfs_mb": tmpfs_mb,
    }
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="sbx-") as workdir,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        os.chmod(workdir, 0o777)  # shadowed by the sandbox's tmpfs; the mount point must be reachable
        opts["workdir"] = workdir
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", os.path.abspath(__file__), "--child", json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            start_new_session=True,
            close_fds=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        ns = None
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.write(code.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        status = None
        deadline = t0 + timeout
        while proc.poll() is None:
            cur = _ns_link(proc.pid, "pid_for_children")
            if cur is not None:
                ns = cur
            if time.monotonic() > deadline:
                status = "timeout"
                break
            time.sleep(0.01)
        _kill_namespace(ns, proc.pid)  # always: reap leftovers (background children, daemons)
        proc.wait()
        out.seek(0)
        err.seek(0)
        stdout = out.read(max_output).decode(errors="replace")
        stderr_full = err.read(1 << 16).decode(errors="replace")
    first, _, stderr = stderr_full.partition("\n")
    try:
        isolation = json.loads(first)["isolation"]
    except (ValueError, KeyError):
        isolation, stderr = "unknown", stderr_full
    rc = proc.returncode
    if rc == 97:
        status = "no_sandbox"
    if status is None:
        if rc == 0:
            status = "passed"
        elif rc is not None and (rc < 0 or 128 < rc < 128 + 65):
            sig = -rc if rc < 0 else rc - 128
            status = f"killed:{signal.Signals(sig).name}" if sig in signal.Signals._value2member_map_ else "failed"
        else:
            status = "failed"
    return Result(
        passed=status == "passed" and isolation != "unknown",
        status=status,
        returncode=rc,
        isolation=isolation,
        seconds=round(time.monotonic() - t0, 3),
        stdout=stdout,
        stderr=stderr[-max_output:],
    )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:  # quick manual check: python sandbox.py FILE.py
        print(json.dumps(asdict(run_program(open(sys.argv[1]).read())), indent=1))
