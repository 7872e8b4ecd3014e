"""The window's INI parser (app/gui/ini.py) against the oracle it replaces, QSettings: each reads
what the other writes, for every kind of value the window keeps (QSettings only ever sees files
without serialised objects here)."""
import pytest
from PySide6.QtCore import QByteArray, QSettings

from app.gui.ini import IniSettings, loads

TEXTS = {
    "source/file": "/music/a, b; c=d \"quoted\" \\back\\slash é 日本.wav",
    "source/device": "  padded  ",
    "source/kind": "@at the start",
    "table/reference": "",
    "models/variants": "regular,continual",
    "frontend": "musicnn",
}
BLOB = bytes(range(256)) + b"\x00\x01abc\x7f\xff0123456789abcdef"


def test_values_written_by_qsettings_read_back_here(tmp_path):
    qt = QSettings(str(tmp_path / "qt.ini"), QSettings.IniFormat)
    for k, v in TEXTS.items():
        qt.setValue(k, v)
    qt.setValue("window/geometry", QByteArray(BLOB))
    qt.setValue("models/layers", 2)
    qt.setValue("view/smoothing_s", 2.5)
    qt.setValue("source/loop", False)
    qt.setValue("extra/list", ["a", "b, c"])
    qt.sync()
    ours = IniSettings(tmp_path / "qt.ini")
    assert ours.problems == [] and ours.refused == []
    for k, v in TEXTS.items():
        assert ours.value(k) == v, k
    assert ours.value("window/geometry") == BLOB
    assert (ours.value("models/layers"), ours.value("view/smoothing_s"), ours.value("source/loop")) == ("2", "2.5", "false")
    assert ours.value("extra/list") == ["a", "b, c"]


def test_values_written_here_read_back_in_qsettings(tmp_path):
    ours = IniSettings(tmp_path / "ours.ini")
    for k, v in TEXTS.items():
        ours.setValue(k, v)
    ours.setValue("window/geometry", QByteArray(BLOB))
    ours.setValue("models/layers", 2)
    ours.setValue("source/loop", True)
    ours.sync()
    qt = QSettings(str(tmp_path / "ours.ini"), QSettings.IniFormat)
    for k, v in TEXTS.items():
        assert qt.value(k) == v, k
    assert bytes(qt.value("window/geometry")) == BLOB
    assert qt.value("models/layers") == "2" and qt.value("source/loop") == "true"
    again = IniSettings(tmp_path / "ours.ini")                    # and here again
    assert again.value("window/geometry") == BLOB and again.value("source/file") == TEXTS["source/file"]


@pytest.mark.parametrize("text", [
    "[a]\nk=@Variant(\\0\\0\\0\\x7f)\n",
    "[a]\nk=\"@Variant(\\0)\"\n",                       # quoted: still a variant once unescaped
    "[a]\nk=\\x40Variant(\\0)\n",                        # the @ escaped
    "[a]\nk=\\100Variant(\\0)\n",                        # the @ in octal
    "[a]\nk=ok, @Variant(\\0)\n",                        # one element of a list
    "[a]\nk=@DateTime(\\0)\n",                           # any other serialised type
])
def test_every_spelling_of_a_serialised_value_is_refused(text):
    values, refused = loads(text.encode())
    assert refused == ["a/k"] and values == {}


def test_plain_text_that_starts_with_at_signs_stays_text():
    values, refused = loads(b"[a]\nk=@@Variant(x)\nj=@plain\n")
    assert values == {"a/k": "@Variant(x)", "a/j": "@plain"} and refused == []


def test_a_settings_file_over_its_size_limit_is_not_read(tmp_path):
    (tmp_path / "big.ini").write_bytes(b"[a]\nk=" + b"x" * (1 << 20) + b"\n")
    s = IniSettings(tmp_path / "big.ini")
    assert s.values == {} and "over the 1,048,576" in s.problems[0]


def test_a_settings_path_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    import os
    os.mkfifo(tmp_path / "s.ini")
    s = IniSettings(tmp_path / "s.ini")
    assert s.values == {} and "not a regular file" in s.problems[0]
