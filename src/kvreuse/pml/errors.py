"""Errors raised by the PML front end.

Every error is a ``ValueError`` so that a server can map all of them to an HTTP 400:

- ``PMLSyntaxError``: the markup itself is wrong (not well-formed XML, an unknown tag, a
  missing or malformed attribute, a refused DTD/entity, a size or depth limit). Always
  carries the 1-based ``line`` and ``column`` of the offending spot.
- ``PMLSemanticError``: the markup is well formed but means something impossible (unknown
  module, two members of one union selected, missing or over-long argument, duplicate
  names, unknown schema). Names the ``module`` and/or ``parameter`` involved and, when the
  error comes from a parsed document, its line and column too.
"""

from __future__ import annotations


class PMLError(ValueError):
    """Base class of every error the PML front end raises."""


class PMLSyntaxError(PMLError):
    """Bad markup, located by 1-based ``line`` and ``column``."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(f"{message} (line {line}, column {column})")
        self.reason = message
        self.line = line
        self.column = column


class PMLSemanticError(PMLError):
    """Well-formed markup with an impossible meaning.

    ``module`` is the qualified module name (``"parent/child"``) the error is about, or
    ``None``; ``parameter`` the parameter name, or ``None``. ``line``/``column`` locate
    the element in the document the error was found in, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        module: str | None = None,
        parameter: str | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(message + where)
        self.reason = message
        self.module = module
        self.parameter = parameter
        self.line = line
        self.column = column
