"""The plain-text whitespace rule, in one place.

PML documents are indented like code, but the model should see the text, not the
indentation of the markup. Each run of character data between two tags is normalised:

1. Lines after the first are dedented by their common leading whitespace (blank lines
   ignored), so code keeps its relative indentation; trailing whitespace on each line
   is removed.
2. Leading and trailing whitespace of the whole run (including blank lines) is removed.
   An empty run disappears.
3. What separated the run from the element before it becomes a single ``lead``
   separator: ``"\\n"`` if the removed whitespace held a line break, ``" "`` if it held
   only spaces/tabs, ``""`` if there was none. The first item in a module, union member,
   role block or prompt, and the item right after a role block (whose markers already
   separate it), get ``""``. A module passes its own lead to its first item.

So "<module name='m'>\\n    Hello world\\n</module>" tokenises exactly as the text
"Hello world" does in a plain prompt, and role block contents tokenise as the chat
template renders message content.
"""

from __future__ import annotations

import os


def normalise(raw: str, *, whole_file: bool = False) -> str:
    """Apply rules 1 and 2 to one run of character data.

    In markup, text that starts on the tag's own line is not part of the indentation
    (like ``inspect.cleandoc``), so put code on its own line after the tag. With
    ``whole_file`` (a ``src`` file) every line, the first included, is dedented.
    """
    lines = [line.rstrip() for line in raw.split("\n")]
    head, rest = ([], lines) if whole_file else (lines[:1], lines[1:])
    indents = [line[: len(line) - len(line.lstrip())] for line in rest if line]
    common = os.path.commonprefix(indents) if indents else ""
    body = head + [line[len(common) :] for line in rest]
    return "\n".join(body).strip()


def separator(whitespace: str) -> str:
    """Rule 3: the single separator standing for ``whitespace`` (may be empty)."""
    if not whitespace:
        return ""
    return "\n" if "\n" in whitespace else " "


def leading_whitespace(raw: str) -> str:
    return raw[: len(raw) - len(raw.lstrip())]


def trailing_whitespace(raw: str) -> str:
    return raw[len(raw.rstrip()) :]
