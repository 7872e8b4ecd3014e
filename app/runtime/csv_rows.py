"""Step records to a CSV file, one whole row at a time.

Each row is formatted first, then written with unbuffered writes and counted as written only when
all of its bytes are: if the disk fills up, a quota is reached or a signal arrives mid-row, the
file is cut back to the rows before it. A CSV written here never ends in part of a row.

The file is one the run creates itself: a file already at the path is removed first (a link: the
link, never its target; a file with other names keeps its contents there), then the new one is
made with O_EXCL. Cells that a spreadsheet would take for a formula (``= + - @``, tab, CR at the
start of a text cell) get a leading ``'``; numbers are written as they are.
"""
from __future__ import annotations

import csv
import errno
import io
import os


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value):
    """A text cell that a spreadsheet would run as a formula, prefixed with ``'``; others as they are."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


STDOUT = "-"           # a CSV path that means standard output


def create(path: str) -> int:
    """A new file at ``path`` for this run alone (see the module's docstring); ``-``: a copy of
    standard output's descriptor."""
    if path == STDOUT:
        return os.dup(1)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o666)
    except FileExistsError:
        if os.path.isdir(path) and not os.path.islink(path):
            raise IsADirectoryError(errno.EISDIR, "is a folder", path) from None
        os.unlink(path)
        return os.open(path, flags, 0o666)


class CsvRows:
    """``write(row)`` appends a dict as a CSV row (the first row's keys are the header)."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self.fields: list[str] | None = None
        self.rows = 0             # complete data rows in the file
        self.size = 0             # bytes of the complete rows (and header)

    def write(self, row: dict) -> None:
        if self.fd is None:
            self.fd = create(self.path)
            self.fields = list(row)
            self._put(self._line(self.fields))
        self._put(self._line([row.get(k, "") for k in self.fields]))
        self.rows += 1

    @property
    def created(self) -> bool:
        """Whether the file was made (it is at the first row)."""
        return self.fields is not None

    @staticmethod
    def _line(values) -> bytes:
        buf = io.StringIO()
        csv.writer(buf).writerow([safe_cell(v) for v in values])
        return buf.getvalue().encode("utf-8")

    def _put(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except BaseException:
            if self.path != STDOUT:
                os.ftruncate(self.fd, self.size)    # shrinking needs no space
            raise
        self.size += len(data)

    def close(self) -> None:
        if self.fd is not None:
            try:
                if self.path != STDOUT:
                    os.fsync(self.fd)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
