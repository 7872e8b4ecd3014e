"""Running a `nystream` command in the test's own process, through its entry point (app.cli.main,
which main.py and the `nystream` script call): no interpreter start, no second import of torch."""
import contextlib
import io
import sys
from dataclasses import dataclass


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_command(*argv) -> Ran:
    """``nystream ARGV``: its exit code and what it printed on sys.stdout / sys.stderr (a
    SystemExit's message as the interpreter prints it). Output written to descriptor 1 itself
    (``--csv -``) is not caught: run those in a process."""
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True) for _ in range(2))
    from app.cli import main
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    return Ran(code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode())
