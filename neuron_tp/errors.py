"""The error type for mistakes in what the user gave (an option, a file, a model, data).

:class:`UserError` says what is wrong and what would be valid. The command line prints it as
one line from one rank and exits non-zero (``NEURON_TP_DEBUG=1`` shows the traceback); any
other exception is a bug and keeps its traceback.

When the ranks of a job learn of a failure from each other (:func:`neuron_tp.parallel.agreement.
check_agreement`, :func:`neuron_tp.checkpoint.agree.agree`), every rank raises and the error
records which rank reports it (:func:`set_reporter`): the lowest rank that failed on its own,
so the root cause is printed once, not the other ranks' echo of it.
"""

from __future__ import annotations

__all__ = ["UserError", "reporter", "set_reporter"]


class UserError(ValueError):
    """Bad input from the user: the message names the problem and the fix."""


def set_reporter(error: BaseException, rank: int | None) -> BaseException:
    """Record on ``error`` that rank ``rank`` prints it (None: whichever rank holds it, rank 0
    under a launcher); returns ``error``."""
    try:
        error.ntp_reporter = rank  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that takes no attributes
        pass
    return error


def reporter(error: BaseException) -> int | None:
    """The rank recorded by :func:`set_reporter`, None when none was."""
    return getattr(error, "ntp_reporter", None)
