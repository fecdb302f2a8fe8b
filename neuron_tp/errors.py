"""The error type for mistakes in what the user gave (an option, a file, a model, data).

:class:`UserError` says what is wrong and what would be valid. The command line prints it as
one line from one rank and exits non-zero (``NEURON_TP_DEBUG=1`` shows the traceback); any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input from the user: the message names the problem and the fix."""
