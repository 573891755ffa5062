"""Domain errors. Each carries one line a user can act on; the CLI maps the class to an exit code."""

from __future__ import annotations


class QbuildError(Exception):
    """Base of every error the CLI reports as one line without a traceback."""

    exit_code = 1


class UserError(QbuildError):
    """Bad input a user can fix: a recipe, a checkpoint, a flag, a path. Nothing was written."""

    exit_code = 2


class RecipeError(UserError):
    """A recipe that does not parse or validate; the message starts with file:line:column and the field."""


class BuildError(QbuildError):
    """A build step failed (a step raised, a verify gate did not pass, --frozen would change the lock)."""

    exit_code = 1


class InfraError(QbuildError):
    """The environment failed us: a remote, the disk, a cluster."""

    exit_code = 3


class ConfigError(UserError, ValueError):
    """A config.json that qbuild cannot read: one line naming the file (`origin`) and the field.

    `message` is the line without the file, so that the converter can re-raise it as its own CheckpointError.
    """

    def __init__(self, origin: str, field: str, message: str):
        self.origin, self.field, self.message = origin, field, message
        super().__init__(f"{origin}: {message}")
