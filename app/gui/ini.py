"""The window's settings file: Qt's INI format read and written here, never by QSettings.

QSettings deserialises ``@Variant(...)`` values with QDataStream when it parses a section (any
read, and the merge before any write), and PySide6 unpickles a ``PyObjectWrapper`` there: a
crafted settings file would run code. This reader keeps every value as data: strings, lists of
strings (an unquoted ``a,b``) and bytes (``@ByteArray(...)``, the saved window layout). Any other
``@Type(...)`` value is refused unread and its key named in ``refused``.

The grammar is Qt's (QSettingsPrivate::iniUnescapedStringList): ``[section]`` headers (``General``
is the top level), ``key=value`` lines, ``;`` comments, double quotes, C escapes (``\\n``, ``\\x41``,
octal ``\\101``), a backslash at a line's end continuing it, ``%XX`` in keys. Files written here read
back in Qt, and Qt's files read here.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from audio.files import atomic_write_text

MAX_BYTES = 1 << 20              # a settings file is a few kB; a larger one is not read
ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           '"': '"', "?": "?", "'": "'", "\\": "\\"}
HEX, OCT = set("0123456789abcdefABCDEF"), set("01234567")


class IniSettings:
    """The subset of QSettings the window uses (``value``, ``setValue``, ``sync``, ``fileName``),
    over a file that this class alone parses. ``problems``: lines about what could not be read
    (the whole file, or refused keys); ``refused``: the keys whose values were refused unread."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.values: dict[str, object] = {}
        self.refused: list[str] = []
        self.problems: list[str] = []
        self._read()

    def fileName(self) -> str:                        # noqa: N802 - QSettings' spelling
        return str(self.path)

    def value(self, key: str, default=None):
        return self.values.get(key, default)

    def setValue(self, key: str, value) -> None:      # noqa: N802
        self.values[key] = value

    def remove(self, key: str) -> None:
        self.values.pop(key, None)

    def keys(self) -> list[str]:
        return list(self.values)

    def sync(self) -> None:
        """Write every value (atomically: the old file or the new one, never a part)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, dumps(self.values))

    def _read(self) -> None:
        try:                                             # a FIFO or device: refused, never waited on
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                data = f.read(MAX_BYTES + 1)             # never more than the limit, whatever it holds
        except FileNotFoundError:
            return
        except OSError as e:
            self.problems.append(f"{self.path} cannot be read ({e.strerror}); defaults used")
            return
        if len(data) > MAX_BYTES:
            self.problems.append(f"{self.path} is over the {MAX_BYTES:,} bytes a settings file may "
                                 f"have; defaults used")
            return
        self.values, self.refused = loads(data)
        for key in self.refused:
            self.problems.append(f"{key}: a serialised object, not a setting (ignored unread)")


def loads(data: bytes) -> tuple[dict[str, object], list[str]]:
    """INI bytes -> (key -> str | list[str] | bytes, keys refused unread)."""
    values: dict[str, object] = {}
    refused: list[str] = []
    section = ""
    for line in logical_lines(data):
        stripped = line.strip()
        if not stripped or stripped[0] in ";#":
            continue
        if stripped.startswith("["):
            end = stripped.find("]")
            name = unescape_key(stripped[1:end if end > 0 else len(stripped)])
            section = "" if name.lower() == "general" else name.lstrip("%") + "/"
            continue
        if "=" not in line:
            continue
        raw_key, raw_value = line.split("=", 1)
        key = section + unescape_key(raw_key.strip())
        if not key.strip("/"):
            continue
        items, is_list = split_value(raw_value)
        converted = [typed(s) for s in items]
        if any(c is REFUSED for c in converted):
            refused.append(key)
            values.pop(key, None)
            continue
        values[key] = converted if is_list else converted[0]
    return values, refused


REFUSED = object()


def typed(s: str):
    """Qt's stringToVariant for the types this file holds; anything else is REFUSED unread."""
    if not s.startswith("@"):
        return s
    if s.startswith("@@"):
        return s[1:]
    if s.startswith("@ByteArray(") and s.endswith(")"):
        return s[len("@ByteArray("):-1].encode("latin-1", "replace")
    if s.startswith("@String(") and s.endswith(")"):
        return s[len("@String("):-1]
    if s == "@Invalid()":
        return None
    return REFUSED if "(" in s else s


def logical_lines(data: bytes):
    """The file's lines, a trailing backslash joining a line to the next (outside quotes)."""
    text = data.decode("utf-8", "surrogateescape")
    pending = ""
    for raw in text.splitlines():
        if raw.endswith("\\") and not raw.endswith("\\\\"):
            pending += raw[:-1]
            continue
        yield pending + raw
        pending = ""
    if pending:
        yield pending


def unescape_key(raw: str) -> str:
    """``%XX`` and ``%UXXXX`` escapes; ``\\`` separates groups like ``/``."""
    out, i = [], 0
    while i < len(raw):
        c = raw[i]
        if c == "%" and raw[i + 1:i + 2] == "U" and all(ch in HEX for ch in raw[i + 2:i + 6]) and len(raw) >= i + 6:
            out.append(chr(int(raw[i + 2:i + 6], 16)))
            i += 6
        elif c == "%" and len(raw) >= i + 3 and all(ch in HEX for ch in raw[i + 1:i + 3]):
            out.append(chr(int(raw[i + 1:i + 3], 16)))
            i += 3
        else:
            out.append("/" if c == "\\" else c)
            i += 1
    return "".join(out)


def split_value(raw: str) -> tuple[list[str], bool]:
    """A raw value -> its unescaped strings, and whether it was a list (a comma outside quotes).
    Whitespace around an item is dropped unless quoted or escaped."""
    items, cur, quoted, is_list, i = [], [], False, False, 0     # cur: (char, kept) pairs

    def add(c: str, kept: bool) -> None:
        cur.append((c, kept))

    while i < len(raw):
        c = raw[i]
        if c == "\\" and i + 1 < len(raw):
            nxt = raw[i + 1]
            if nxt in ESCAPES:
                add(ESCAPES[nxt], True)
                i += 2
            elif nxt == "x":
                j = i + 2
                while j < len(raw) and raw[j] in HEX:
                    j += 1
                add(chr(int(raw[i + 2:j], 16) & 0xFFFF) if j > i + 2 else "x", True)
                i = j
            elif nxt in OCT:
                j = i + 1
                while j < len(raw) and raw[j] in OCT:
                    j += 1
                add(chr(int(raw[i + 1:j], 8) & 0xFFFF), True)
                i = j
            else:
                add(nxt, True)
                i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == "," and not quoted:
            items.append(cur)
            cur, is_list = [], True
        elif c == ";" and not quoted:
            break
        else:
            add(c, quoted)
        i += 1
    items.append(cur)
    return [trimmed(item) for item in items], is_list


def trimmed(item: list[tuple[str, bool]]) -> str:
    """The item's text without the unquoted, unescaped whitespace at its ends."""
    start, end = 0, len(item)
    while start < end and item[start][0].isspace() and not item[start][1]:
        start += 1
    while end > start and item[end - 1][0].isspace() and not item[end - 1][1]:
        end -= 1
    return "".join(c for c, _ in item[start:end])


def dumps(values: dict[str, object]) -> str:
    """Values (str, bool, int, float, bytes or QByteArray, lists of str) as Qt INI text."""
    sections: dict[str, list[str]] = {}
    for key in sorted(values):
        section, _, name = key.rpartition("/") if "/" in key else ("General", "", key)
        sections.setdefault(section, []).append(f"{escape_key(name)}={escape_value(values[key])}")
    order = sorted(sections, key=lambda s: (s != "General", s))
    return "".join(f"[{escape_key(s) if s != 'General' else s}]\n" + "\n".join(lines) + "\n\n"
                   for s, lines in ((s, sections[s]) for s in order))


def escape_key(key: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_./ ") else f"%{ord(c):02X}"
                   if ord(c) < 256 else f"%U{ord(c):04X}" for c in key).replace("/", "\\")


def escape_value(value) -> str:
    if value is None:
        return "@Invalid()"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(escape_value(str(v)) for v in value) if value else "@Invalid()"
    if not isinstance(value, str):                        # bytes, QByteArray
        return escape_string("@ByteArray(" + bytes(value).decode("latin-1") + ")", binary=True)
    return escape_string("@" + value if value.startswith("@") else value)


def escape_string(s: str, binary: bool = False) -> str:
    """Qt's iniEscapedString: C escapes, hex for control bytes (and any byte >= 0x7f when
    ``binary``), a hex digit after a hex escape escaped too, quotes where ``;,=`` or edge
    spaces would otherwise be read differently."""
    out, after_hex = [], False
    for c in s:
        code = ord(c)
        if after_hex and c in HEX:
            out.append(f"\\x{code:x}")
            continue
        after_hex = False
        if c == "\0":
            out.append("\\0")
            after_hex = True
        elif c in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(c)])
        elif c in '"\\':
            out.append("\\" + c)
        elif code <= 0x1F or (binary and code >= 0x7F):
            out.append(f"\\x{code:x}")
            after_hex = True
        else:
            out.append(c)
    text = "".join(out)
    if any(c in s for c in ";,=") or s[:1] == " " or s[-1:] == " ":
        text = f'"{text}"'
    return text
