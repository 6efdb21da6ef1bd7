"""Run model-generated code (HumanEval completions and their tests) in a throw-away sandbox.

This is the only place lmforge executes code a model wrote. Layers (standard library and Linux
only; no preexec_fn, so the caller may be multi-threaded):

* a fresh launcher process (`python -I -B sandbox.py --child OPTS`, a bundle of files on stdin);
* new mount, network, IPC and pid namespaces (`unshare` through ctypes; as non-root also a user
  namespace mapping our uid to 65534): pid 1 of the new pid namespace makes itself non-dumpable,
  re-binds every mount read-only, mounts a small private tmpfs over an empty temporary directory
  (the only writable place) and a fresh /proc, writes the bundle's files there, then runs the
  program as pid 2 with rlimits (CPU time, address space, file size, processes, open files, no
  core) as uid 65534 with no capabilities and PR_SET_NO_NEW_PRIVS; the network namespace has no
  interface up, so connect() fails even to 127.0.0.1; when pid 1 exits the kernel kills
  everything left in the namespace;
* a wall-clock timeout in the parent, then SIGKILL of the launcher's group and a sweep of every
  process still in the sandbox's pid namespace.

`run_program(code)` runs one program; its exit status is its result. `run_tests(prompt,
completion, test, entry_point)` is HumanEval's verdict, and it must not be forgeable by the code
it judges: a program that holds both the candidate and its tests can print whatever a verdict
looks for and exit 0 before the tests run (it can read a marker from its own source). So two
processes share the sandbox. pid 2, the driver (this file, run with `--driver`), runs the trusted
prompt (its helpers, e.g. `poly`) and `test` code and calls `check(proxy)`; `proxy(*args)` sends
the arguments over a pipe to the candidate's process (`--candidate`: `prompt + completion`,
then a loop that answers calls) and decodes its reply. Values cross as tagged JSON (`encode`,
`decode`: no pickle, no eval, exact types, replies bounded by MAX_REPLY); a raise, a garbled or
oversized reply or a dead candidate fails the call. The verdict is the driver's exit status
alone: 0 only after `check()` returned. The candidate cannot reach it: the tests reach the
driver on a stdin the candidate never holds (an anonymous memfd), the driver is non-dumpable
(execve made it dumpable again, so it says so itself, before the candidate exists: no ptrace,
no /proc/<driver>/fd or /mem to the same uid), pid 1 too, and the candidate's stdout is
/dev/null (its stderr is the driver's, for diagnostics only). Signals it may send the driver
only make the driver fail.

RLIMIT_NPROC is ignored by the kernel for kuid 0, hence the drop to uid 65534 in root mode (a
fork bomb reached 8,000 processes without it). Where namespaces cannot be created (no root and
no unprivileged user namespaces), nothing runs: the result is status `no_sandbox` and the
sample scores 0 -- a Python-level guard is not a sandbox.

Why by hand: no maintained Python package isolates a subprocess this way; bubblewrap or nsjail
would, but they are system packages the pipeline cannot assume, and lm-eval's own `code_eval`
runs code in-process with a Python-level guard (and needs the hub). The driver and candidate
sides live in this file because it is the one file `evaluation.build` copies beside the task
(and inside the sandbox only the standard library is there).
"""

from __future__ import annotations

import ctypes
import json
import linecache
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

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
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
SANDBOX_UID = 65534  # "nobody" inside the namespace
HARNESS, CANDIDATE = "harness.py", "candidate.py"  # run_tests' files in the sandbox's work dir
MAX_REPLY = 4 << 20  # bytes of one reply from the candidate; HumanEval's answers are a few hundred


@dataclass
class Result:
    passed: bool
    status: str  # passed | failed | timeout | killed:<signal> | no_sandbox
    returncode: int | None
    isolation: str  # namespaces:root | namespaces:userns | unknown (setup failed, nothing ran)
    seconds: float
    stdout: str
    stderr: str


# ----------------------------------------------------------------------------- values on the pipe
def encode(value: Any) -> Any:
    """A JSON-able form of a value that keeps its exact type: None, bools and strings stand for
    themselves, everything else is a one-key object whose key names the type. Numbers are text so
    that ints of any size and nan/inf survive (json's own ints stop at 4,300 digits)."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return {"i": hex(value)}
    if isinstance(value, float):
        return {"f": value.hex()}
    if isinstance(value, bytes):
        return {"b": value.hex()}
    if isinstance(value, dict):
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    for kind, tag in ((tuple, "t"), (list, "l"), (frozenset, "fs"), (set, "s")):
        if isinstance(value, kind):
            return {tag: [encode(v) for v in value]}
    raise TypeError(f"a {type(value).__name__} cannot cross the sandbox's pipe")


def _text(body: Any) -> str:
    if type(body) is not str:
        raise ValueError(f"expected text, got {type(body).__name__}")
    return body


def _members(body: Any) -> list[Any]:
    if type(body) is not list:
        raise ValueError(f"expected a list, got {type(body).__name__}")
    return [decode(v) for v in body]


def _pairs(body: Any) -> dict[Any, Any]:
    if type(body) is not list or any(type(p) is not list or len(p) != 2 for p in body):
        raise ValueError("expected a list of [key, value] pairs")
    return {decode(k): decode(v) for k, v in body}


DECODERS: dict[str, Callable[[Any], Any]] = {
    "i": lambda body: int(_text(body), 16),
    "f": lambda body: float.fromhex(_text(body)),
    "b": lambda body: bytes.fromhex(_text(body)),
    "t": lambda body: tuple(_members(body)),
    "l": _members,
    "fs": lambda body: frozenset(_members(body)),
    "s": lambda body: set(_members(body)),
    "d": _pairs,
}


def decode(node: Any) -> Any:
    """The value `encode` made `node` from. Anything else raises (ValueError, KeyError, TypeError
    for an unhashable key, RecursionError): what the driver decodes comes from untrusted code."""
    if node is None or type(node) in (bool, str):
        return node
    if type(node) is not dict or len(node) != 1:
        raise ValueError(f"not an encoded value: {type(node).__name__}")
    ((tag, body),) = node.items()
    return DECODERS[tag](body)


def _line(message: Any) -> bytes:
    return json.dumps(message).encode() + b"\n"  # ensure_ascii: no newline inside a message


class CandidateError(Exception):
    """The candidate did not answer a call with a value (it raised, or the channel broke). A plain
    Exception named after nothing builtin: a reply can never become SystemExit or StopIteration."""


class ChannelError(CandidateError):
    """The channel broke: the candidate's process ended, or its reply was not a message."""


def parse_reply(line: bytes) -> Any:
    """The value one reply line carries; CandidateError where the candidate raised, ChannelError
    for anything else (end of file, a reply over MAX_REPLY or cut short, a message that is not ours)."""
    if not line:
        raise ChannelError("the candidate's process ended without answering")
    if len(line) > MAX_REPLY or not line.endswith(b"\n"):
        raise ChannelError(f"a reply over {MAX_REPLY} bytes or cut short")
    try:
        ((kind, body),) = json.loads(line).items()
        if kind == "ok":
            return decode(body)
        raised = _text(body)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, they were not an answer
        raise ChannelError(f"a garbled reply ({type(exc).__name__})") from None
    if kind != "error":
        raise ChannelError(f"a reply of unknown kind {kind[:40]!r}")
    raise CandidateError(f"the candidate raised {raised[:80]}")


# ----------------------------------------------------------------------------- inside: driver and candidate
def _set_undumpable() -> None:
    """No ptrace, /proc/<pid>/fd, /mem or /environ of this process for another of the same uid
    without CAP_SYS_PTRACE (which nothing in the sandbox holds). execve resets the flag, so every
    process that needs it sets it itself."""
    _check(_libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


class Candidate:
    """The entry point as `check()` sees it: each call runs in the candidate's own process (this
    file with `--candidate`), which holds nothing of the driver's but its two pipe ends."""

    def __init__(self, entry_point: str) -> None:
        calls_r, calls_w = os.pipe()
        replies_r, replies_w = os.pipe()
        subprocess.Popen(
            [sys.executable, "-I", "-B", os.path.abspath(__file__), "--candidate"]
            + [str(calls_r), str(replies_w), entry_point],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # only the reply pipe speaks for it
            pass_fds=(calls_r, replies_w),
            close_fds=True,
        )
        os.close(calls_r)
        os.close(replies_w)
        self._calls = os.fdopen(calls_w, "wb")
        self._replies = os.fdopen(replies_r, "rb")
        self.broken: str | None = None  # set once the channel broke: every later call fails too

    def __call__(self, *args: Any) -> Any:
        if self.broken is not None:
            raise ChannelError(self.broken)
        try:
            self._calls.write(_line(encode(list(args))))
            self._calls.flush()
            return parse_reply(self._replies.readline(MAX_REPLY + 1))
        except ChannelError as exc:
            self.broken = str(exc)
            raise
        except OSError as exc:  # its end of the call pipe is gone
            self.broken = f"the candidate's process is gone ({exc.strerror})"
            raise ChannelError(self.broken) from None


def _exec_source(source: str, name: str, namespace: dict[str, Any]) -> None:
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # tracebacks quote the line
    exec(compile(source, name, "exec"), namespace)


def _run_check(spec: dict[str, str]) -> None:
    namespace: dict[str, Any] = {"__name__": "__tests__"}
    _exec_source(spec["prompt"], "<prompt>", namespace)  # trusted: helpers the tests call (e.g. poly)
    _exec_source(spec["test"], "<test>", namespace)
    candidate = Candidate(spec["entry_point"])
    namespace[spec["entry_point"]] = candidate  # as in one program: tests may call it by name (HumanEval/33)
    namespace["check"](candidate)
    if candidate.broken is not None:  # a test that swallowed the failure does not make a pass
        raise ChannelError(candidate.broken)
    sys.stdout.flush()


def driver_main() -> None:
    """pid 2 of a run_tests sandbox; its exit status is the verdict."""
    _set_undumpable()  # first, while no other process runs in the sandbox
    spec = json.loads(sys.stdin.read())  # the tests: on a memfd only this process holds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # drop the memfd (sys.stdin.close() would leave fd 0 open)
    os.close(devnull)
    try:
        _run_check(spec)
    except BaseException:  # noqa: BLE001 - an assertion, a raise, an interrupt: all of them fail
        try:
            traceback.print_exc(limit=-3)  # the innermost frames: the failed assert
            sys.stderr.flush()
        finally:
            os._exit(1)
    os._exit(0)  # no atexit, no finalizers: nothing may run after the verdict


def _answer(function: Callable[..., Any], call: bytes) -> bytes:
    try:
        return _line({"ok": encode(function(*decode(json.loads(call))))})
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: the driver judges a raise
        return _line({"error": type(exc).__name__})


def candidate_main(calls_fd: int, replies_fd: int, entry_point: str) -> None:
    """The candidate's process: run `prompt + completion`, then answer calls until the pipe closes.
    Everything here is as untrusted as the completion itself (it runs in this process); the driver
    trusts nothing it sends. Not `__main__`: like HumanEval's own harness, demo code under a main
    guard does not run."""
    path = os.path.abspath(CANDIDATE)
    namespace: dict[str, Any] = {"__name__": "__candidate__", "__file__": path}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    function = namespace[entry_point]
    with os.fdopen(calls_fd, "rb") as calls, os.fdopen(replies_fd, "wb") as replies:
        for call in calls:
            replies.write(_answer(function, call))
            replies.flush()


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


def _exec_program(opts: dict, argv: list[str], isolation: str, drop_to_uid: int | None = None) -> None:
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
    os.execve(exe, [exe, "-I", "-B", *argv], env)


def _write_bundle(workdir: str, bundle: dict) -> int:
    """Write the bundle's files into the sandbox's tmpfs; returns a memfd holding the program's
    stdin (run_tests' tests: no file, so nothing else in the sandbox can open it by a path)."""
    for name, text in bundle["files"].items():
        with open(os.path.join(workdir, name), "w") as f:
            f.write(text)
    fd = os.memfd_create("stdin")
    with open(fd, "wb", closefd=False) as f:
        f.write(bundle.get("stdin", "").encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def child_main(opts: dict) -> None:
    bundle = json.loads(sys.stdin.read())
    try:
        mode = _enter_namespaces()
    except OSError as e:
        print(f"sandbox: namespaces unavailable: {e}", file=sys.stderr)
        os._exit(97)
    pid1 = os.fork()
    if pid1 == 0:  # pid 1 of the new pid namespace: mounts, then run the program as pid 2
        try:
            # in userns mode pid 1 has the sandbox's uid: its fds (our stdout) stay out of reach even
            # without the capabilities that shield it today
            _set_undumpable()
            _setup_mounts(opts["workdir"], opts["tmpfs_mb"], bind_python=mode == "root")
            stdin = _write_bundle(opts["workdir"], bundle)
            pid2 = os.fork()
            if pid2 == 0:
                os.dup2(stdin, 0)
                _exec_program(opts, bundle["argv"], f"namespaces:{mode}", SANDBOX_UID if mode == "root" else None)
            os.close(stdin)
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


def _run(
    bundle: dict,
    timeout: float = 10.0,
    cpu_s: int = 10,
    as_mb: int = 1024,
    fsize_mb: int = 16,
    nproc: int = 32,
    nofile: int = 64,
    tmpfs_mb: int = 64,
    max_output: int = 4096,
) -> Result:
    """Run a bundle (files for the work dir, the interpreter's argv, the program's stdin) sandboxed;
    the program's exit status is the result. Never raises for anything the code does."""
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
            proc.stdin.write(json.dumps(bundle).encode())
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


def run_program(code: str, **limits: Any) -> Result:
    """Run `code` as a program sandboxed (limits: see `_run`); passed means it exited 0."""
    return _run({"files": {"prog.py": code}, "argv": ["prog.py"]}, **limits)


def run_tests(prompt: str, completion: str, test: str, entry_point: str, **limits: Any) -> Result:
    """HumanEval's verdict on a completion: passed only if `check()` of `test` returned, calling the
    candidate (`prompt + completion`, its own process) over a pipe; see the module docstring."""
    with open(os.path.abspath(__file__)) as f:
        harness = f.read()
    bundle = {
        "files": {HARNESS: harness, CANDIDATE: prompt + completion},
        "argv": [HARNESS, "--driver"],
        "stdin": json.dumps({"prompt": prompt, "test": test, "entry_point": entry_point}),
    }
    return _run(bundle, **limits)


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role == "--driver":
        driver_main()
    elif role == "--candidate":
        candidate_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif role == "--child":
        child_main(json.loads(sys.argv[2]))
    else:  # quick manual check: python sandbox.py FILE.py
        print(json.dumps(asdict(run_program(open(sys.argv[1]).read())), indent=1))
