"""Exceptions raised by rsmem.

Each failure mode has its own type so callers can react to it without parsing messages, and each
message names the offending value. Every operation that raises one of these leaves the memory exactly
as it was before the call.
"""

from __future__ import annotations


class RsmemError(Exception):
    """Base class of every error rsmem raises on purpose."""


class InvalidBatchError(RsmemError, ValueError):
    """A batch breaks one of the batch rules (llama.cpp's decode returns -1 for these)."""


class NoSlotError(RsmemError):
    """The memory has no room for the batch (llama.cpp's decode returns 1); nothing was changed."""


class NoFreeSequenceError(RsmemError, RuntimeError):
    """Every sequence is taken (by running requests and sessions): a session cannot be opened now."""


class UnknownSequenceError(RsmemError, ValueError):
    """A sequence id outside ``[0, n_seq_max)`` was given where one is required."""


class StateFormatError(RsmemError, ValueError):
    """Saved state bytes are truncated, corrupt, or do not fit this memory; nothing was changed."""


class ModelFormatError(RsmemError, ValueError):
    """A model file is malformed, of an unsupported architecture, or misses a tensor."""


class InvalidRequestError(RsmemError, ValueError):
    """A generation request is invalid: a sampling parameter out of its range, a token outside the
    vocabulary, a slot that does not exist, a prompt above a limit. ``param`` names the field (the
    Python name, e.g. ``temperature``); the engine refuses such a request before queueing it.

    ``detail`` is the message without the field's name, so a caller can name the field as its user
    typed it (``--temp`` on the command line, ``temperature`` in JSON): ``exc.named("--temp")``.
    """

    def __init__(self, param: str | None, detail: str) -> None:
        self.param = param
        self.detail = detail
        super().__init__(f"{param} {detail}" if param else detail)

    def named(self, name: str) -> str:
        """The message with the field called ``name``."""
        return f"{name} {self.detail}"
