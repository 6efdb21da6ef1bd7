"""The supervisor every long subprocess runs under: `python -m lmforge.processes.supervise [opts] -- CMD ...`.

It sits between lmforge and the real command (DeepSpeed, accelerate/TRL, lm-eval, vLLM,
the quantizer) and guarantees what a plain `Popen` cannot:

- the command runs in its own process group, and the supervisor is a child subreaper, so
  every descendant (ranks, engine workers) stays findable even after its parent exits;
- if the supervisor itself is SIGKILLed, the command gets SIGTERM (a parent-death signal) and
  stops its tree; anything left is still in the supervisor's session, where `serve status/stop`
  and the launcher that started it find it (`session_members`, `stop_session`);
- when the process that launched it dies -- killed, crashed, OOM-killed, or evicted -- it
  stops the whole tree within about a second, so no rank trains on as an orphan;
- on SIGTERM it stops the tree (SIGTERM, then SIGKILL after `--grace` seconds) and only then
  exits; with `--hold-fd` it keeps the step's lock file open until then, so the step lock
  is released only after every process of the step is gone;
- `--deadline` (epoch seconds) enforces the step's wall-clock limit (exit code 124).

Only the standard library is imported: it starts in tens of milliseconds. Why not a
library: no maintained package combines parent-death watching, subreaping and a held lock
(`prctl`-based ones are Linux wrappers of the same two calls used here).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TIMED_OUT = 124
_stop_requested = False


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: descendants are found by process group only
        pass


def _die_with(parent: int) -> None:
    """In the command, before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux).

    The command then stops its own tree as it would on `stop` (vLLM, DeepSpeed and torchrun do);
    whatever ignores it is still found by session (`session_members`) by `lmforge serve
    status/stop` and by the launcher that started the supervisor.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the supervisor died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def _processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, session id) of every process, read from /proc ([] without it)."""
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(name), fields[0], int(fields[1]), int(fields[3])))
    return found


def session_members(session: int) -> list[int]:
    """Live processes of session `session`: a supervisor started with its own session keeps every
    process it started in it (the command is only put in a group of its own), so this finds them
    all after the supervisor itself is gone (Linux keeps a session id from reuse while it has members)."""
    return [pid for pid, state, _, sid in _processes() if sid == session and pid != session and state != "Z"]


def stop_session(session: int, grace: float = 10.0) -> list[int]:
    """SIGTERM every process left in `session`, SIGKILL what remains after `grace`; returns who was there."""
    members = session_members(session)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in session_members(session):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while session_members(session) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not session_members(session):
            break
    return members


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _descendants(root: int | None = None) -> list[int]:
    """Living descendants of `root` (default: us; as subreaper, orphans of the tree are re-parented to us)."""
    children: dict[int, list[int]] = {}
    for pid, state, parent, _ in _processes():
        if state != "Z":
            children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(os.getpid() if root is None else root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _signal_tree(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass
    for pid in _descendants():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_tree(child: subprocess.Popen, grace: float) -> None:
    """SIGTERM the command's group and every descendant; SIGKILL what is left after `grace`."""
    _signal_tree(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap()
        if child.poll() is not None and not _descendants():
            return
        time.sleep(0.1)
    _signal_tree(child.pid, signal.SIGKILL)
    while _descendants() or child.poll() is None:
        _reap()
        time.sleep(0.05)


def kill_from_outside(pid: int) -> None:
    """SIGKILL a supervisor and its whole tree, for when the supervisor itself does not answer: the
    command runs in a process group of its own, so killing the supervisor's group alone would
    leave the command running as an orphan."""
    tree = _descendants(pid)
    for target in [pid, *tree]:
        for kill in (os.killpg, os.kill):  # each process's group (the command's), then the process
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _say(message: str) -> None:
    try:  # the reader of our output may be the very process that died
        print(message, file=sys.stderr, flush=True)
    except OSError:
        pass


def _on_sigterm(signum: int, frame: object) -> None:
    global _stop_requested
    _stop_requested = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmforge.processes.supervise")
    parser.add_argument("--watch", type=int, help="stop everything when this process is gone")
    parser.add_argument("--hold-fd", type=int, help="an inherited fd (the step lock) to keep open until the end")
    parser.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--deadline", type=float, help="epoch seconds after which the command is stopped")
    parser.add_argument("--quiet", action="store_true", help="say nothing when asked to stop (a normal end)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    # a launcher may block SIGTERM in its threads (the CLI takes it in one thread of its own), and a
    # blocked mask is inherited across exec: unblock it, for us and for the command we start
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)
    _become_subreaper()
    try:  # a session of our own (if the launcher did not start us in one): `session_members` finds the tree by it
        os.setsid()
    except OSError:  # already its leader
        pass
    launcher = os.getppid()
    # a group of its own (signalled as one), in our session (found by it if we are killed)
    parent = os.getpid()
    child = subprocess.Popen(command, process_group=0, preexec_fn=lambda: _die_with(parent))  # noqa: PLW1509
    reason = ""
    while child.poll() is None:
        if _stop_requested:
            reason = "stopped"
        elif args.watch and (not pid_alive(args.watch) or (args.watch == launcher and os.getppid() != launcher)):
            reason = f"process {args.watch} that launched it is gone"
        elif args.deadline and time.time() > args.deadline:
            reason = "time limit reached"
        if reason:
            if not (args.quiet and reason == "stopped"):
                _say(f"lmforge.processes.supervise: {reason}; stopping {' '.join(command[:3])} ...")
            stop_tree(child, args.grace)
            break
        time.sleep(0.2)
    _reap()
    if _descendants():  # the command exited but left processes behind: they go with it
        stop_tree(child, args.grace)
    if reason == "time limit reached":
        return TIMED_OUT
    code = child.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
