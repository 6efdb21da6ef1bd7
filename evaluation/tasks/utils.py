"""Helpers the task YAMLs name with `!function utils.<name>`: HumanEval's sandboxed scoring and the
chat tasks' exact match (`verify.py`, lmforge's one answer check, the one RL rewards with).

lm-eval imports this file by path (its module name is the path), so `sandbox.py` beside it is
loaded explicitly. Each completion is judged by `sandbox.run_tests`: the tests run in their own
process and call the candidate (`prompt + completion`) in another over a pipe, and the sample
passes only if that test process exits 0 after `check()` returned. Nothing the completion prints
or how it exits counts: it has no channel to the verdict (a marker printed after `check()` had
one, since the completion could read the marker from its own source). The verdict of every
sample (status, isolation, stderr tail) lands in lm-eval's per-sample log.
"""

import importlib.util
import json
import os
import re
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


def verdict(doc, completion):
    try:
        result = sandbox.run_tests(doc["prompt"], completion, doc["test"], doc["entry_point"], **LIMITS)
    except Exception as exc:  # noqa: BLE001 - a sandbox failure is a score of 0, never a crash
        return json.dumps({"passed": False, "status": f"sandbox_error: {type(exc).__name__}: {exc}"})
    return json.dumps(
        {
            "passed": result.passed,
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
    """lmforge_chat_exact: the verifier RL rewards with (lmforge/text/verify.py), on the greedy answer."""
    return {"exact_match": 1.0 if verify.is_correct(results[0], doc["answer"]) else 0.0}


def passkey_process(doc, results):
    """The pass key task: right when the first run of digits in the answer is the key."""
    digits = re.search(r"\d+", results[0] or "")
    return {"acc": 1.0 if digits and digits.group(0) == doc["answer"] else 0.0}


def ppl_process(doc, results):
    """(log-likelihood, tokens) of the scored continuation: perplexity is aggregated over tokens."""
    loglikelihood, _ = results[0]
    return {"token_perplexity": (loglikelihood, doc["tokens"])}


def token_perplexity(items):
    import math

    return math.exp(-sum(ll for ll, _ in items) / max(1, sum(n for _, n in items)))
