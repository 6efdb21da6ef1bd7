"""The HumanEval verdict: only code that passes the tests passes, whatever the generated code does.

The candidate (prompt + completion) and the tests run as two processes in one sandbox; the tests'
process (the driver) calls the candidate over a pipe and its exit status alone is the verdict.
These tests attack that channel the way generated code can: forging a marker read from its own
source, writing to the driver's or pid 1's descriptors, tracing the driver, signalling it, and
sending replies that are not values. Everything goes through `utils.py` as lm-eval loads it
(by path, beside `sandbox.py`), except the probes that need the sandbox's full stderr.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from types import ModuleType
from typing import Any

import pytest

from evaluation.build import SANDBOX, TEMPLATES, VERIFY
from lmforge.text.humaneval import humaneval_items

# Today's forgery: the marker printed after check() sat in the program's own source.
FORGE_IN_CALL = """    import os, re
    found = set()
    for name in [globals().get("__file__") or "", "prog.py"] + os.listdir("."):
        try:
            found.update(re.findall(r"PASSED-[0-9a-f]+", open(name, errors="replace").read()))
        except OSError:
            pass
    for token in found:
        print(token, flush=True)
    os._exit(0)
"""
FORGE_AT_IMPORT = "    return None\n\n\ndef _forge():\n" + FORGE_IN_CALL + "\n\n_forge()\n"

# Every other way out of the candidate's process: pid 1's and the parent's descriptors and memory,
# ptrace, signals, and the test code itself (reading it would let code copy the expected answers).
# Each probe's outcome goes to stderr as `probe <name>: <outcome>`; then it forges as above and
# interrupts the driver.
PROBES = """    import ctypes, os, re, signal, sys
    ppid = os.getppid()
    def report(name, action):
        try:
            outcome = action() or "done"
        except Exception as exc:
            outcome = type(exc).__name__
        print(f"probe {name}: {outcome}", file=sys.stderr, flush=True)
    def write(path):
        with open(path, "w") as f:
            f.write("PASSED-0000000000000000\\n")
    def find_tests():
        paths = os.listdir(".")
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            paths += [f"/proc/{pid}/cmdline", f"/proc/{pid}/environ", f"/proc/{pid}/mem"]
            try:
                paths += [f"/proc/{pid}/fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                pass
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # its own pipes would block
                blob = os.read(fd, 1 << 20)
                os.close(fd)
            except OSError:
                continue
            if b"def " + b"check(" in blob:  # split: this very source must not match
                return "found:" + path
        return "not-found"
    def trace(pid):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
            raise PermissionError(ctypes.get_errno(), "ptrace")
    def listfd(pid):
        os.listdir(f"/proc/{pid}/fd")
    report("pid1-stdout", lambda: write("/proc/1/fd/1"))
    report("parent-stdout", lambda: write(f"/proc/{ppid}/fd/1"))
    report("parent-stdin", lambda: open(f"/proc/{ppid}/fd/0", "rb").read())
    report("parent-fds", lambda: listfd(ppid))
    report("parent-mem", lambda: open(f"/proc/{ppid}/mem", "r+b"))
    report("parent-ptrace", lambda: trace(ppid))
    report("pid1-ptrace", lambda: trace(1))
    report("tests", find_tests)
    report("pid1-sigint", lambda: os.kill(1, signal.SIGINT))
    found = set()
    for name in [globals().get("__file__") or "", "prog.py"] + os.listdir("."):
        try:
            found.update(re.findall(r"PASSED-[0-9a-f]+", open(name, errors="replace").read()))
        except OSError:
            pass
    for token in found:
        print(token, flush=True)
    report("parent-sigint", lambda: os.kill(ppid, signal.SIGINT))
    os._exit(0)
"""
REFUSED_PROBES = (
    "pid1-stdout",
    "parent-stdout",
    "parent-stdin",
    "parent-fds",
    "parent-mem",
    "parent-ptrace",
    "pid1-ptrace",
)


@pytest.fixture(scope="module")
def utils(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """`utils.py` as lm-eval imports it: by path, from a folder laid out as `evaluation.build` lays it out."""
    folder = tmp_path_factory.mktemp("task")
    shutil.copy2(TEMPLATES / "utils.py", folder / "utils.py")
    shutil.copy2(SANDBOX, folder / "sandbox.py")
    shutil.copy2(VERIFY, folder / "verify.py")
    spec = importlib.util.spec_from_file_location("lmforge_test_task_utils", folder / "utils.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def problems() -> list[dict[str, Any]]:
    return humaneval_items()


def _verdict(utils: ModuleType, problem: dict[str, Any], completion: str) -> dict[str, Any]:
    return json.loads(utils.verdict(problem, completion))


@pytest.mark.parametrize("completion", [FORGE_IN_CALL, FORGE_AT_IMPORT], ids=["in-call", "at-import"])
def test_a_completion_that_prints_the_marker_from_its_own_source_does_not_pass(
    utils: ModuleType, problems: list[dict[str, Any]], completion: str
) -> None:
    """Before: the program's source held the marker, so reading `__file__` or `prog.py`, printing it
    and exiting 0 passed. Now the candidate's process has no marker to find and no say in the verdict."""
    verdict = _verdict(utils, problems[0], completion)
    assert not verdict["passed"] and verdict["status"] == "failed", verdict
    assert verdict["isolation"].startswith("namespaces:")


def test_a_completion_cannot_reach_the_driver_or_pid_1(utils: ModuleType, problems: list[dict[str, Any]]) -> None:
    """Writes to /proc/1/fd/1 and the parent's descriptors, ptrace, the parent's memory, signals to pid 1
    and to the parent, then the marker forgery: the verdict is a plain failure (not a harness crash, not a
    timeout), and with the sandbox's own stderr each probe is seen refused (the driver and pid 1 are not
    dumpable; the tests never sit where the candidate can read them)."""
    verdict = _verdict(utils, problems[0], PROBES)
    assert not verdict["passed"] and verdict["status"] == "failed", verdict
    problem = problems[0]
    result = utils.sandbox.run_tests(problem["prompt"], PROBES, problem["test"], problem["entry_point"])
    outcomes = dict(
        line[len("probe ") :].split(": ", 1) for line in result.stderr.splitlines() if line.startswith("probe ")
    )
    refused = {name: outcomes.get(name) for name in REFUSED_PROBES}
    assert all(outcome not in (None, "done") for outcome in refused.values()), result.stderr
    assert outcomes["tests"] == "not-found", result.stderr
    assert not result.passed and result.status == "failed" and result.isolation.startswith("namespaces:")


def test_canonical_solutions_pass_and_wrong_answers_fail(utils: ModuleType, problems: list[dict[str, Any]]) -> None:
    """The first 20 reference solutions pass through lm-eval's filter (helpers such as `poly` live in the
    prompt, which the driver runs too); a wrong answer fails, and so does a list where a tuple is expected
    (values cross the pipe with their exact types)."""
    docs = problems[:20]
    verdicts = utils.sandbox_filter([[p["canonical_solution"]] for p in docs], docs)
    assert [json.loads(v[0])["passed"] for v in verdicts] == [True] * len(docs), verdicts
    sum_product = next(p for p in problems if p["entry_point"] == "sum_product")
    as_list = "    import math\n    return [sum(numbers), math.prod(numbers)]\n"
    as_tuple = "    import math\n    return (sum(numbers), math.prod(numbers))\n"
    assert _verdict(utils, sum_product, as_tuple)["passed"]
    assert not _verdict(utils, sum_product, as_list)["passed"]
    wrong = _verdict(utils, problems[0], "    return True\n")
    assert not wrong["passed"] and wrong["status"] == "failed" and "AssertionError" in wrong["stderr_tail"]


ROUND_TRIP = [
    None,
    True,
    False,
    0,
    -(10**5000),
    1.5,
    -0.0,
    float("inf"),
    float("-inf"),
    "",
    "h\u00e9llo\n\ud800",
    b"\x00\xff",
    [],
    [1, [2, (3,)]],
    (),
    (1, "a", None),
    {(1, 2): [3], "k": {"n": frozenset({1})}, 3: set(), None: 0.25, True: b""},
    {1, "x", (2, 3)},
    frozenset({frozenset({1}), 2}),
]


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (`1 == True` and `[1] == (1,)` would hide a loss)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and (not isinstance(a, (set, frozenset)) or sorted(map(repr, a)) == sorted(map(repr, b)))


@pytest.mark.parametrize("value", ROUND_TRIP + [float("nan")], ids=lambda v: type(v).__name__)
def test_values_cross_the_pipe_with_their_exact_types(utils: ModuleType, value: Any) -> None:
    wire = json.dumps(utils.sandbox.encode(value))
    assert _same(utils.sandbox.decode(json.loads(wire)), value), wire


@pytest.mark.parametrize(
    "reply",
    [
        b"",  # the candidate's process ended
        b'{"ok": null}',  # cut short: no end of line
        b'{"ok": "' + b"x" * (5 << 20) + b'"}\n',  # larger than any reply may be
        b'{"ok": 1}\n',  # a bare number: every number is tagged
        b'{"ok": [1]}\n',  # a bare list
        b'{"ok": NaN}\n',
        b'{"ok": {"x": "1"}}\n',  # an unknown tag
        b'{"ok": {"i": "1", "f": "1"}}\n',  # two tags
        b'{"ok": {"i": 12}}\n',  # a body of the wrong type
        b'{"ok": {"d": [[{"l": []}, null]]}}\n',  # an unhashable key
        b'{"ok": {"s": [{"l": []}]}}\n',  # an unhashable member
        b'{"ok": {"d": [[null]]}}\n',  # a pair of one
        b'{"ok": {"f": "pi"}}\n',
        b'{"ok": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",  # deeper than any value
        b'{"ok": null, "error": "x"}\n',
        b'{"exit": 0}\n',  # a kind of reply that does not exist
        b'{"error": 3}\n',
        b"[]\n",
        b"\xff\n",
    ],
    ids=lambda r: repr(r[:24]),
)
def test_a_reply_that_is_not_an_answer_is_a_broken_channel(utils: ModuleType, reply: bytes) -> None:
    with pytest.raises(utils.sandbox.ChannelError):
        utils.sandbox.parse_reply(reply)


def test_a_raise_in_the_candidate_is_a_plain_exception_in_the_driver(utils: ModuleType) -> None:
    """Not the exception it names: a reply saying SystemExit must not end the driver with status 0."""
    for name in ("SystemExit", "StopIteration", "KeyboardInterrupt", "AssertionError"):
        with pytest.raises(utils.sandbox.CandidateError) as caught:
            utils.sandbox.parse_reply(json.dumps({"error": name}).encode() + b"\n")
        assert type(caught.value) is utils.sandbox.CandidateError and name in str(caught.value)
    assert utils.sandbox.parse_reply(b'{"ok": {"t": [{"i": "0x2"}]}}\n') == (2,)


def test_values_the_encoding_cannot_carry_fail_the_call(utils: ModuleType) -> None:
    for value in (object(), [lambda: 0], {1: 1j}):
        with pytest.raises(TypeError):
            utils.sandbox.encode(value)


# Replies written straight to the candidate's pipes (any descriptor it holds) instead of through its host.
RAW_REPLY = """    import os
    for fd in range(3, 64):
        try:
            os.write(fd, {payload!r})
        except OSError:
            pass
    os._exit(0)
"""


@pytest.mark.parametrize(
    "payload",
    [
        b'{"ok": {"x": 1}}\n',  # not a value
        b'{"ok": 1}\n',  # an untagged number
        b'{"error": "SystemExit"}\n',  # the candidate raised: a failure, never an exit of the driver
        b'{"ok": true}\n{"ok": true}\n' * 4,  # answers queued ahead, then gone
        b"x" * (5 << 20),  # larger than any reply may be
    ],
    ids=["unknown-tag", "untagged", "system-exit", "queued", "oversized"],
)
def test_a_reply_that_is_not_an_answer_fails_the_sample(
    utils: ModuleType, problems: list[dict[str, Any]], payload: bytes
) -> None:
    verdict = _verdict(utils, problems[0], RAW_REPLY.format(payload=payload))
    assert not verdict["passed"] and verdict["status"] == "failed", verdict
