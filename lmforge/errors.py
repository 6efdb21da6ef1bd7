"""Error types that carry their own retry semantics.

A retry only helps when the failure came from the outside world (a killed rank, a
preempted node, a flaky filesystem). Configuration errors, divergence and parity
failures fail the same way every time, so they are marked non-retryable and the
Prefect retry condition (`tasks.retry.should_retry`) refuses to retry them.
"""


class LmforgeError(Exception):
    """Base class; `retryable` says whether running again could succeed."""

    retryable = False


class ConfigError(LmforgeError):
    """A configuration problem: unknown key, wrong type, missing file."""


class StoreUnreachable(LmforgeError):
    """A remote workspace's store cannot be reached, or refuses this machine's credentials (one line
    naming the URL, before any step runs)."""


class UndeclaredConfigRead(LmforgeError):
    """A step read a config field it did not declare in its `reads` (a programming error).

    Not an AttributeError on purpose: `getattr(view, name, default)` must not turn it into a
    silent default."""


class DataError(LmforgeError):
    """Input data that cannot be processed at all (not per-record problems, which are quarantined)."""


class DeterministicError(LmforgeError):
    """A failure that would repeat on retry (divergence, failed parity check)."""


class UntrustedName(DeterministicError):
    """A name read from a shared store (a manifest's file list, a listing) that would leave its folder."""


class GateFailed(DeterministicError):
    """The model did not pass what must hold before it ships (evaluation, contamination, SLO, a quality gate)."""


class TrainingDiverged(DeterministicError):
    """Too many consecutive loss spikes or non-finite losses."""

    anomalies: list = []  # the anomaly report's rows, when the stage could read it


class ParityError(DeterministicError):
    """The exported model does not reproduce the training engine's logits."""


class RunStopped(LmforgeError):
    """The run was stopped (Ctrl-C, cancellation, SIGTERM); retrying would undo that decision."""


class StepTimeout(LmforgeError):
    """A step ran past its configured time limit (`runtime.step_timeout_s`) and was stopped."""


class RetryableError(LmforgeError):
    """A transient failure; retrying resumes from the last verified state."""

    retryable = True


class SourceUnavailable(RetryableError):
    """A remote source (a dataset hub) could not be reached; it may answer on the next attempt."""


class TrainingInterrupted(RetryableError):
    """A rank was killed or preempted; the next attempt resumes from a checkpoint."""


# Python's own errors of code or data: the same inputs raise them again on every attempt
PROGRAMMING_ERRORS = (
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    NotImplementedError,
    AssertionError,
    NameError,
    ArithmeticError,
    ImportError,
)


def is_retryable(exc: BaseException) -> bool:
    """Retry lmforge errors only when they say so; of other exceptions, retry those from the
    outside world (OSError, network and API errors, a worker process that died) and not
    programming errors."""
    if isinstance(exc, LmforgeError):
        return exc.retryable
    if type(exc).__name__ == "TaskRunTimeoutError":  # Prefect's step time limit: like StepTimeout
        return False
    return not isinstance(exc, PROGRAMMING_ERRORS)
