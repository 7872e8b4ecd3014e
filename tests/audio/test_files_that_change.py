"""Files that change under a run: replaced, overwritten, truncated or deleted by a second process
between the check and the read, or while reading or looping. Each ends the run with one
AudioFileError (or, for a rename or a delete during a pass, reads the open file to its end as it
was), and nothing is ever decoded with the old file's rate or length."""
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from audio.decoding import BLOCK_SECONDS
from audio.errors import AudioFileError
from audio.melspec import HOP
from audio.sources import FileSource
from audio_helpers import tone, write

ROOT = Path(__file__).resolve().parents[2]


def second_process(code: str, *args) -> None:
    """Run ``code`` in another Python process (sys.argv[1:] = args), as another program would."""
    subprocess.run([sys.executable, "-c", "import sys, os, numpy as np, soundfile as sf\n" + code,
                    *map(str, args)], check=True, cwd=ROOT)


OVERWRITE = "sf.write(sys.argv[1], np.zeros((44100 * 3, 2), np.float32), 44100)"  # same inode
REPLACE = ("sf.write(sys.argv[1] + '.new.wav', np.zeros(48000 * 4, np.float32), 48000)\n"
           "os.replace(sys.argv[1] + '.new.wav', sys.argv[1])")                   # a new inode
TRUNCATE = "os.truncate(sys.argv[1], os.path.getsize(sys.argv[1]) // 3)"
DELETE = "os.remove(sys.argv[1])"


@pytest.fixture
def song(tmp_path) -> Path:
    return write(tmp_path / "song.wav", tone(10.0, 22050, 330.0), 22050)


def unchanged_hops(path: Path) -> list[np.ndarray]:
    return list(FileSource(path))


@pytest.mark.parametrize("change, says", [(OVERWRITE, "it was modified"), (REPLACE, "replaced"),
                                          (TRUNCATE, "it was modified"),
                                          (DELETE, "can no longer be read")])
def test_a_file_changed_between_the_check_and_the_read_is_refused(song, change, says):
    source = FileSource(song)                  # probed: 22050 Hz, mono, 10 s
    second_process(change, song)
    with pytest.raises(AudioFileError) as e:
        next(iter(source))
    text = str(e.value)
    assert "\n" not in text and "changed since it was checked (22050 Hz, 1 channel(s)" in text
    assert says in text and "the run ends here" in text, text


@pytest.mark.parametrize("change", [OVERWRITE, TRUNCATE])
def test_a_file_written_to_while_it_is_read_ends_the_run_at_the_next_block(song, change):
    expected = unchanged_hops(song)
    hops = iter(FileSource(song))
    first = next(hops)                         # the first block (BLOCK_SECONDS) is read
    second_process(change, song)
    taken = [first]
    with pytest.raises(AudioFileError) as e:
        for h in hops:
            taken.append(h)
    text = str(e.value)                        # the position read when the change was seen
    assert "changed while it was being read, after " in text and "it was modified (" in text, text
    assert 0 < float(text.split("being read, after ")[1].split(" s")[0]) <= 2 * BLOCK_SECONDS
    # what came before is the old file's, decoded at its own rate; the block read after the
    # change is never delivered (one block of 2 s at most was resampled ahead)
    assert len(taken) <= BLOCK_SECONDS * 16000 / HOP + 1
    np.testing.assert_array_equal(np.stack(taken), np.stack(expected[:len(taken)]))


@pytest.mark.parametrize("change", [REPLACE, DELETE])
def test_a_rename_or_delete_while_reading_reads_the_open_file_and_the_next_loop_pass_refuses(song, change):
    expected = unchanged_hops(song)
    source = FileSource(song, loop=True)
    hops = iter(source)
    taken = [next(hops)]
    second_process(change, song)
    with pytest.raises(AudioFileError) as e:
        for h in hops:
            taken.append(h)
    assert "changed since it was checked" in str(e.value)
    assert len(taken) == len(expected)         # the whole first pass, the old file's hops exactly
    np.testing.assert_array_equal(np.stack(taken), np.stack(expected))


def test_classify_on_a_file_overwritten_mid_stream_says_so_and_keeps_its_rows(song, tmp_path):
    out = tmp_path / "steps.csv"
    p = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "classify", str(song), "--pace", "realtime",
                          "--csv", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (out.exists() and len(out.read_text().splitlines()) >= 3):
        assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()[1][-2000:]
        time.sleep(0.05)
    second_process(OVERWRITE, song)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "Traceback" not in err, err[-2000:]
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "changed while it was being read" in errors[0], err[-2000:]
    rows = out.read_text().splitlines()[1:]
    assert out.read_text().endswith("\n") and f"# {len(rows)} rows in {out}" in err
    assert "# verdict over file:song.wav" in err and 2 <= len(rows) < 40   # 10 s: 40 hops
