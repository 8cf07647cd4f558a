"""A hardened XML reader: PML text in, a located element tree out.

This is the only place that touches XML. It uses expat directly with every feature that
can reach outside the document or blow up its size refused:

- any ``<!DOCTYPE>`` (and therefore every entity and notation declaration) is refused, so
  "billion laughs" and external entities cannot happen; only the five predefined entities
  and character references are understood;
- external entity references and parameter entities are refused;
- the document size (characters), element nesting depth and element count are capped by
  ``MarkupLimits``.

PML text is written by people, and code and prose hold ``0 <= i < n`` and ``a && b``. A ``<``
or ``&`` that cannot start markup (``<`` not followed by a name, ``/``, ``!`` or ``?``; ``&``
not followed by a name or ``#``) is kept as literal text, byte for byte, outside CDATA,
comments and processing instructions; anything that does start a tag or a reference and is
malformed is still an error at its own line and column. (The reference implementation parses
with lxml's recover mode, which silently deletes such characters.)

Every failure is a ``PMLSyntaxError`` with a 1-based line and column.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.parsers import expat

from kvreuse.pml.errors import PMLSyntaxError


@dataclass(frozen=True)
class MarkupLimits:
    """Caps applied while reading one document. Validated where built."""

    max_chars: int = 2_000_000  # whole document, in characters
    max_depth: int = 32  # element nesting, the root element is depth 1
    max_elements: int = 20_000  # elements in one document

    def __post_init__(self) -> None:
        for field_name in ("max_chars", "max_depth", "max_elements"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"MarkupLimits.{field_name} must be >= 1")


@dataclass(frozen=True)
class CharData:
    """A maximal run of character data between two tags (comments do not split it)."""

    text: str
    line: int
    column: int


@dataclass(frozen=True)
class Element:
    """An XML element: tag, attributes in document order, children in document order."""

    tag: str
    attrs: tuple[tuple[str, str], ...]
    children: tuple[Element | CharData, ...]
    line: int
    column: int

    def attr(self, name: str) -> str | None:
        for key, value in self.attrs:
            if key == name:
                return value
        return None


class _Builder:
    """Expat callbacks that build the tree; one instance per document."""

    def __init__(self, parser: expat.XMLParserType, limits: MarkupLimits, shifts: _Shifts) -> None:
        self._parser = parser
        self._limits = limits
        self._shifts = shifts  # where literal '<' / '&' were escaped, to report original columns
        # Each open element: (tag, attrs, children list, line, column).
        self._stack: list[tuple[str, tuple[tuple[str, str], ...], list, int, int]] = []
        self._text: list[str] = []
        self._text_at: tuple[int, int] | None = None
        self._count = 0
        self.root: Element | None = None

    def _where(self) -> tuple[int, int]:
        line = self._parser.CurrentLineNumber
        return line, _unshift(self._shifts, line, self._parser.CurrentColumnNumber) + 1

    def _flush_text(self) -> None:
        if self._text and self._stack:
            line, column = self._text_at or (1, 1)
            self._stack[-1][2].append(CharData("".join(self._text), line, column))
        self._text = []
        self._text_at = None

    def start(self, tag: str, attrs: list[str]) -> None:
        self._flush_text()
        line, column = self._where()
        self._count += 1
        if self._count > self._limits.max_elements:
            raise PMLSyntaxError(f"more than {self._limits.max_elements} elements", line, column)
        if len(self._stack) + 1 > self._limits.max_depth:
            raise PMLSyntaxError(f"elements nested deeper than {self._limits.max_depth}", line, column)
        pairs = tuple(zip(attrs[0::2], attrs[1::2]))
        self._stack.append((tag, pairs, [], line, column))

    def end(self, tag: str) -> None:
        self._flush_text()
        name, attrs, children, line, column = self._stack.pop()
        element = Element(name, attrs, tuple(children), line, column)
        if self._stack:
            self._stack[-1][2].append(element)
        else:
            self.root = element

    def chars(self, data: str) -> None:
        if self._text_at is None:
            self._text_at = self._where()
        self._text.append(data)

    def refuse(self, what: str):
        def handler(*_args) -> None:
            line, column = self._where()
            raise PMLSyntaxError(f"{what} is not allowed in PML", line, column)

        return handler


def read_markup(text: str, limits: MarkupLimits = MarkupLimits()) -> Element:
    """Parse ``text`` into an ``Element`` tree.

    Raises ``PMLSyntaxError`` (with line and column) for malformed XML, a DTD, entity
    declarations or references other than the predefined ones, external references, or
    when a ``MarkupLimits`` cap is exceeded.
    """
    if not isinstance(text, str):
        raise TypeError("PML text must be str")
    if len(text) > limits.max_chars:
        raise PMLSyntaxError(
            f"document is {len(text)} characters, more than the limit {limits.max_chars}",
            1,
            1,
        )
    escaped, shifts = _escape_literals(text)
    parser = expat.ParserCreate(encoding="utf-8")
    builder = _Builder(parser, limits, shifts)
    parser.buffer_text = False  # one callback per chunk, so positions mark where text starts
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.StartElementHandler = builder.start
    parser.EndElementHandler = builder.end
    parser.CharacterDataHandler = builder.chars
    parser.ordered_attributes = True
    parser.StartDoctypeDeclHandler = builder.refuse("a DOCTYPE declaration")
    parser.EntityDeclHandler = builder.refuse("an entity declaration")
    parser.UnparsedEntityDeclHandler = builder.refuse("an unparsed entity")
    parser.NotationDeclHandler = builder.refuse("a notation declaration")
    parser.ExternalEntityRefHandler = builder.refuse("an external entity reference")
    # Without a DTD, expat reports unknown entities as errors; this handler catches the
    # case where it would otherwise pass them through silently.
    parser.SkippedEntityHandler = builder.refuse("an entity reference")
    try:
        parser.Parse(escaped.encode("utf-8"), True)
    except expat.ExpatError as exc:
        reason = expat.ErrorString(exc.code)
        offset = _unshift(shifts, exc.lineno, exc.offset)
        hint, column = "", offset + 1
        if exc.code == expat.errors.codes[expat.errors.XML_ERROR_INVALID_TOKEN]:
            hint, column = _escape_hint(text, exc.lineno, offset)
        raise PMLSyntaxError(f"malformed markup: {reason}{hint}", exc.lineno, column) from None
    except RecursionError:  # defensive: the depth cap should make this unreachable
        raise PMLSyntaxError("markup nested too deeply", 1, 1) from None
    assert builder.root is not None  # expat guarantees a root element on success
    return builder.root


_Shifts = dict[int, list[tuple[int, int]]]
"""line -> ascending (0-based column in the original line, characters added before it)."""

_LITERAL_SKIP = (("<![CDATA[", "]]>"), ("<!--", "-->"), ("<?", "?>"))  # regions kept as written


def _starts_name(char: str) -> bool:
    return char.isalpha() or char in "_:"


def _escape_literals(text: str) -> tuple[str, _Shifts]:
    """``text`` with every ``<`` / ``&`` that cannot start markup escaped (``&lt;`` /
    ``&amp;``), so expat reads it as the character itself, and where columns moved. CDATA
    sections, comments and processing instructions are copied untouched."""
    out: list[str] = []
    shifts: _Shifts = {}
    line, line_start, added = 1, 0, 0
    i, n, copied = 0, len(text), 0
    while i < n:
        char = text[i]
        if char == "\n":
            line, line_start, added = line + 1, i + 1, 0
            i += 1
            continue
        if char not in "<&":
            i += 1
            continue
        skip = next((end for start, end in _LITERAL_SKIP if text.startswith(start, i)), None)
        if skip is not None:  # jump past the region (counting its lines); malformed: expat says so
            stop = text.find(skip, i)
            stop = n if stop < 0 else stop + len(skip)
            newlines = text.count("\n", i, stop)
            if newlines:
                line, line_start, added = line + newlines, text.rfind("\n", i, stop) + 1, 0
            i = stop
            continue
        following = text[i + 1] if i + 1 < n else ""
        literal = (
            (not (_starts_name(following) or following in "/!?"))
            if char == "<"
            else (not (_starts_name(following) or following == "#"))
        )
        if literal:
            out.append(text[copied:i])
            out.append("&lt;" if char == "<" else "&amp;")
            copied = i + 1
            added += 3 if char == "<" else 4
            shifts.setdefault(line, []).append((i - line_start, added))
        i += 1
    out.append(text[copied:])
    return "".join(out), shifts


def _unshift(shifts: _Shifts, line: int, column: int) -> int:
    """Expat's 0-based ``column`` on ``line`` of the escaped text, in the original text."""
    moved = 0
    for original, added in shifts.get(line, ()):
        if column - added < original + 1:  # expat's column lies before this escape's end
            break
        moved = added
    return column - moved


def _escape_hint(text: str, line: int, offset: int) -> tuple[str, int]:
    """(hint, 1-based column) for expat's error at 0-based ``offset`` of ``line``.

    The hint is for a bare ``&`` or ``<`` in text (code and prose in modules often hold
    them: ``R&B``, ``0 <= x < n``), where the reference's lenient parser silently dropped
    text; the column then points at that character. Otherwise no hint, expat's column."""
    lines = text.split("\n")  # expat counts lines by "\n" only
    if not 1 <= line <= len(lines):
        return "", offset + 1
    # expat reports the position just after the offending character (after the would-be
    # entity name for "&"): look back to it.
    head = lines[line - 1][: offset + 1]
    at = max(head.rfind("&"), head.rfind("<"))
    if at < 0:
        return "", offset + 1
    char, between = head[at], lines[line - 1][at + 1 : offset]
    if (char == "<" and offset - at > 1) or (char == "&" and not all(c.isalnum() or c in "#_" for c in between)):
        return "", offset + 1
    escaped = "&amp;" if char == "&" else "&lt;"
    return (  # point at the bare character itself
        f" (a bare {char!r} in text: write it as {escaped!r}, wrap the text in <![CDATA[...]]>, "
        "or move it to a file named by src=)",
        at + 1,
    )
