"""Helpers the task YAMLs name with `!function utils.<name>`: HumanEval's sandboxed scoring and the
chat tasks' exact match (`verify.py`, lmforge's one answer check, the one RL rewards with).

lm-eval imports this file by path (its module name is the path), so `sandbox.py` beside it is
loaded explicitly. Each completion runs as `prompt + completion + tests + check(entry_point)`
in the sandbox; it passes only if the tests ran to the end: a random marker printed after
`check()` must appear, so code that exits early with status 0 does not pass. The verdict of
every sample (status, isolation, stderr tail) lands in lm-eval's per-sample log.
"""

import importlib.util
import json
import os
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor


def _beside(name, module):
    spec = importlib.util.spec_from_file_location(module, os.path.join(os.path.dirname(__file__), name))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name} beside {__file__}")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)
    return loaded


sandbox = _beside("sandbox.py", "lmforge_eval_sandbox")
verify = _beside("verify.py", "lmforge_eval_verify")

LIMITS = json.loads(os.environ.get("LMFORGE_SANDBOX_LIMITS", "{}"))  # timeout, cpu_s, as_mb, fsize_mb, nproc
WORKERS = int(os.environ.get("LMFORGE_SANDBOX_WORKERS", "2"))


def program(doc, completion, marker):
    return (
        doc["prompt"] + completion + "\n\n" + doc["test"] + "\n" + f"check({doc['entry_point']})\nprint({marker!r})\n"
    )


def verdict(doc, completion):
    marker = "PASSED-" + secrets.token_hex(8)
    try:
        result = sandbox.run_program(program(doc, completion, marker), **LIMITS)
    except Exception as exc:  # noqa: BLE001 - a sandbox failure is a score of 0, never a crash
        return json.dumps({"passed": False, "status": f"sandbox_error: {type(exc).__name__}: {exc}"})
    return json.dumps(
        {
            "passed": result.passed and marker in result.stdout,
            "status": result.status,
            "isolation": result.isolation,
            "seconds": result.seconds,
            "stderr_tail": result.stderr[-300:],
        }
    )


def sandbox_filter(resps, docs):
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = [[pool.submit(verdict, doc, r) for r in rs] for rs, doc in zip(resps, docs)]
        return [[f.result() for f in fs] for fs in futures]


def humaneval_process_verdict(doc, results):
    return {"pass@1": 1.0 if json.loads(results[0])["passed"] else 0.0}


def chat_exact_results(doc, results):
    """lmforge_chat_exact: the verifier RL rewards with (lmforge/verify.py), on the greedy answer."""
    return {"exact_match": 1.0 if verify.is_correct(results[0], doc["answer"]) else 0.0}
