"""Step records to a CSV file, one whole row at a time.

Each row is formatted first, then written with unbuffered writes and counted as written only when
all of its bytes are: if the disk fills up, a quota is reached or a signal arrives mid-row, the
file is cut back to the rows before it. A CSV written here never ends in part of a row.
"""
from __future__ import annotations

import csv
import io
import os


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
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            self.fields = list(row)
            self._put(self._line(self.fields))
        self._put(self._line([row.get(k, "") for k in self.fields]))
        self.rows += 1

    @staticmethod
    def _line(values) -> bytes:
        buf = io.StringIO()
        csv.writer(buf).writerow(values)
        return buf.getvalue().encode("utf-8")

    def _put(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except BaseException:
            os.ftruncate(self.fd, self.size)    # shrinking needs no space
            raise
        self.size += len(data)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.fsync(self.fd)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
