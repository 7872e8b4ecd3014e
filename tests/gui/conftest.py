"""Fixtures of the window tests: a window on a temporary settings file, playing its file or the
demo at 4x (SPEED: a test that counts hops per second of the host's clock asks for 1x), a short
music file."""
import gc

import numpy as np
import pytest

from app.gui.ini import IniSettings
from app.gui.window import MainWindow, Options
from audio_helpers import tone, write
from gui_helpers import SPEED


@pytest.fixture
def make_window(qtbot, tmp_path):
    windows = []

    def make(source=None, variants=("regular", "continual", "continual_nystrom"), n=8, start=True,
             random_vggish=0, speed=SPEED, **kw):
        settings = IniSettings(tmp_path / "settings.ini")
        w = MainWindow(Options(source=source, variants=None if variants is None else list(variants),
                               random_vggish=random_vggish, speed=speed, autostart=False, **kw), settings)
        qtbot.addWidget(w)
        w.slow_panels_s = 0             # every panel on every frame with new hops: tests read them all
        w.show()
        w.window_box.setValue(n)
        w.landmarks_box.setValue(2)
        if start:
            w.start()
        windows.append(w)
        return w
    yield make
    for w in windows:
        w.close()
    # the closed windows' Qt objects are freed here, not by a later test's garbage collection
    gc.collect()


@pytest.fixture
def music_file(tmp_path):
    sweep = np.concatenate([tone(1.0, 22050, f) for f in (220, 330, 440, 660, 880, 1320, 1760, 2640)] * 2)
    return write(tmp_path / "music.wav", sweep, 22050)
