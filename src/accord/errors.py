"""One family of errors for everything a user can fix or a run cannot get past.

Every AccordError carries a message meant to be shown as is (one line per problem) and the
exit code the command ends with; the CLI catches this one base class and prints the message
on stderr. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class AccordError(Exception):
    """Shown to the user as `accord: error: <message>`; the command exits with `exit_code`."""

    exit_code = 2  # bad input: nothing was started


class UserInputError(AccordError, ValueError):
    """A bad value in a recipe, a flag, a file or the environment, found before work starts."""


class RunStopped(AccordError, RuntimeError):
    """A run that started and cannot go on; what is intact is said in the message."""

    exit_code = 1


class CheckpointError(RunStopped):
    """A checkpoint could not be written or used; earlier checkpoints are intact."""
