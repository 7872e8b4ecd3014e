"""The bad-input and fault round of issue #13: token files that would poison training, damaged
resume state, and messages (permission, undecodable bytes, repaired samples, skipped folders)."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import soundfile as sf

from app.offline.extract import extract_gtzan
from audio.decoding import probe
from audio.errors import AudioFileError
from audio.gtzan import GENRES
from audio.tokens.cache import TokenFileError, load_tokens, pack, save_tokens
from audio.vggish import build_embedder
from audio_helpers import tone
from test_gtzan_data import interrupt_extraction, make_gtzan


def token_file(tmp_path, name="t.npz", **change):
    X = np.random.default_rng(0).standard_normal((6, 4, 3)).astype(np.float32)
    d = dict(X=X, labels=np.arange(6) % 3, lengths=np.full(6, 4), ids=np.array([f"g/track{i}" for i in range(6)]),
             genres=np.array(GENRES[:3]), split=np.array([""] * 6), metadata=np.array("{}"))
    d.update(change)
    np.savez(tmp_path / name, **d)
    return tmp_path / name


def test_token_files_with_non_finite_values_empty_features_or_float_labels_are_refused(tmp_path):
    X = np.random.default_rng(0).standard_normal((6, 4, 3)).astype(np.float32)
    X[4, 2, 1] = np.nan
    X[5, 0, 0] = np.inf
    with pytest.raises(TokenFileError, match=r"2 non-finite values in 2 sequence\(s\), the first in row 4 "
                                             r"\(track 'g/track4'\) at token 2"):
        load_tokens(token_file(tmp_path, X=X))
    with pytest.raises(TokenFileError, match=r"T, D >= 1, got shape \(6, 4, 0\)"):
        load_tokens(token_file(tmp_path, X=np.zeros((6, 4, 0), np.float32)))
    with pytest.raises(TokenFileError, match=r"labels must be integers .*float64 \(row 0: 0.5\)"):
        load_tokens(token_file(tmp_path, labels=np.array([0.5, 1, 2, 0, 1, 2])))
    assert load_tokens(token_file(tmp_path)).X.shape == (6, 4, 3)           # the unchanged file loads


def test_train_refuses_a_nan_token_file_and_writes_no_checkpoint(tmp_path):
    X = np.random.default_rng(0).standard_normal((60, 4, 3)).astype(np.float32)
    X[17, 1] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, X=X, labels=np.arange(60) % 3, genres=np.array(GENRES[:3]))
    out = subprocess.run([sys.executable, "main.py", "train", "--tokens", str(path), "--out",
                          str(tmp_path / "m.pt"), "--epochs", "1"], capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "row 17 (track '17') at token 1" in out.stderr
    assert not (tmp_path / "m.pt").exists()


def test_training_stops_at_the_first_non_finite_loss():
    import torch

    from app.offline.training import NonFiniteTrainingError, TrainConfig, fit
    from tiny import tiny_config
    X = torch.randn(40, 6, 16)
    X[7, 3, 0] = float("inf")                       # past the file checks: the loop's own guard
    labels = torch.arange(40) % 4
    splits = {"train": np.arange(30), "val": np.arange(30, 40)}
    with pytest.raises(NonFiniteTrainingError, match=r"epoch 1: the training loss is nan; non-finite outputs "
                                                     r"on sequences 7; training stopped"):
        fit(tiny_config(variant="continual", window=6, num_classes=4), X, labels, np.full(40, 6), splits,
            TrainConfig(epochs=2, batch_size=40), log=lambda s: None)


def test_damaged_parts_and_a_half_written_manifest_are_named_set_aside_and_recomputed(tmp_path, monkeypatch):
    root = make_gtzan(tmp_path / "g", "original", per_genre=2, ext="wav")
    embedder = build_embedder(random_seed=0)
    full = extract_gtzan(root, tmp_path / "full.npz", embedder, log=lambda s: None)
    frontend = interrupt_extraction(root, tmp_path / "part.npz", embedder, monkeypatch, at_call=5)
    parts = tmp_path / "part.npz.parts"
    (parts / "00001.npy").write_bytes(b"")                              # zero-length part
    (parts / "00002.npy").write_bytes((parts / "00002.npy").read_bytes()[:100])   # cut short
    log = []
    resumed = extract_gtzan(root, tmp_path / "part.npz", frontend, log=log.append)
    named = [line for line in log if "is damaged" in line]
    assert len(named) == 2 and "00001.npy" in named[0] and "00002.npy" in named[1]
    assert "resuming: 2 of 6 tracks already done" in log
    np.testing.assert_array_equal(resumed.X, full.X)

    (tmp_path / "half.npz.parts").mkdir()
    (tmp_path / "half.npz.parts" / "manifest.json").write_text('{"tracks": ["blues/blu')
    log = []
    again = extract_gtzan(root, tmp_path / "half.npz", frontend, log=log.append)
    assert any("manifest.json is damaged (JSONDecodeError" in line and "set aside as" in line for line in log)
    assert list(tmp_path.glob("half.npz.parts.damaged-*"))
    np.testing.assert_array_equal(again.X, full.X)


def test_repaired_samples_per_track_and_skipped_folders_are_in_the_token_metadata(tmp_path):
    root = make_gtzan(tmp_path / "g", "original", per_genre=1, ext="wav")
    loud = tone(1.3, 22050, 300.0) * 3
    loud[10:14] = np.nan
    sf.write(str(root / "genres" / "blues" / "blues.00005.wav"), loud, 22050, subtype="FLOAT")
    (root / "genres" / "jazz").mkdir()
    (root / "genres" / "jazz" / "jazz.00001.wav").mkdir()               # a folder named like a track
    log = []
    tokens = extract_gtzan(root, tmp_path / "t.npz", build_embedder(random_seed=0), log=log.append)
    repaired = tokens.metadata["repaired_samples"]
    assert list(repaired) == ["blues/blues.00005.wav"]
    assert repaired["blues/blues.00005.wav"]["nonfinite"] == 4 and repaired["blues/blues.00005.wav"]["clipped"] > 1000
    assert {"id": "genres/jazz/jazz.00001.wav", "reason": "named like a track but not a file"} in tokens.metadata["skipped"]
    assert any("skipped genres/jazz/jazz.00001.wav" in line for line in log)
    assert load_tokens(tmp_path / "t.npz").metadata == json.loads(json.dumps(tokens.metadata))


def test_random_bytes_are_named_with_both_decoders_reasons(tmp_path):
    path = tmp_path / "noise.wav"
    path.write_bytes(os.urandom(5000))
    with pytest.raises(AudioFileError) as e:
        probe(path)
    msg = str(e.value)
    assert msg.startswith(f"cannot decode {path}") and "soundfile: " in msg and "PyAV: " in msg
    assert "; )" not in msg and not msg.endswith(": )") and "\n" not in msg


def as_unprivileged(action) -> str:
    """``action()``'s result or exception, as text, in a forked child that runs as the user
    'nobody' when this process is root (for whom file permissions do not apply)."""
    if os.geteuid() != 0:
        try:
            return f"ok {action()}"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__} {e}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                       # the child: no exec, the modules are loaded
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                text = f"ok {action()}"
            except Exception as e:  # noqa: BLE001
                text = f"{type(e).__name__} {e}"
            os.write(w, text.encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()


def test_unreadable_files_are_permission_errors_not_corrupt_ones(tmp_path):
    tmp_path.chmod(0o755)
    for folder in tmp_path.parents:                    # pytest's folders are private to root
        if folder.stat().st_uid == os.geteuid() and str(folder).startswith(tempfile.gettempdir() + "/"):
            folder.chmod(folder.stat().st_mode | 0o055)
    audio = tmp_path / "locked.wav"
    sf.write(str(audio), tone(1.0, 16000), 16000)
    tokens = tmp_path / "t.npz"
    save_tokens(tokens, pack([np.ones((3, 4))], [0], ["a"], GENRES))
    for path in (audio, tokens):
        path.chmod(0)
    assert as_unprivileged(lambda: probe(audio)) == f"AudioFileError {audio} cannot be read: permission denied"
    assert as_unprivileged(lambda: load_tokens(tokens)) == f"TokenFileError {tokens} cannot be read: permission denied"
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    inside = hidden / "x.wav"
    sf.write(str(inside), tone(1.0, 16000), 16000)
    assert as_unprivileged(lambda: probe(inside)) == f"AudioFileError {inside} cannot be read: permission denied"
