"""User-facing error types.

Every error a user can cause by bad input derives from :class:`WhaleError`; the CLI prints such
errors as one line (no traceback unless ``--debug``) and exits non-zero. Messages name the thing
that is wrong, the bad value, and the fix.
"""


class WhaleError(Exception):
    """Base class of errors caused by user input (annotations, specs, plans, configs)."""


class AnnotationError(WhaleError):
    """A replicate/split scope or ``annotate`` mapping is malformed."""


class CaptureError(WhaleError):
    """A model could not be captured into TaskGraphs."""


class SpecError(WhaleError):
    """A cluster spec, config or plan file violates its schema."""


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (whitespace runs folded), for the command-line tools that
    print an error instead of a traceback; the exception's class name when it has no message."""
    return " ".join(str(error).split()) or type(error).__name__
