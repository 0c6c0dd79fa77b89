"""Errors a stage raises for bad input: the CLI prints the message (no traceback) and exits non-zero.

Messages name the file / row / column, the reason and the fix.
"""


class StageError(RuntimeError):
    """A stage refused its input or could not finish; the message says what to do."""


class TransientError(StageError):
    """A failure that may pass by itself (the network down, a server's 5xx, a timeout): the Prefect flow
    retries these later, with backoff; every other StageError is a refusal that retrying cannot fix."""
