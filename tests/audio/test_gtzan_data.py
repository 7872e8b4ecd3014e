"""GTZAN discovery, splits, token files, resumable extraction, and the musicnn converter."""
import json

import numpy as np
import pytest

from app.offline.extract import extract_gtzan
from audio.gtzan import GENRES, GTZANError, discover, stratified_split
from audio.tokens.cache import TokenFileError, TokenSet, convert_musicnn, load_tokens, pack, save_tokens
from audio.vggish import build_embedder
from audio_helpers import tone


def make_gtzan(root, layout, per_genre=2, seconds=1.3, genres=GENRES[:3], ext="wav"):
    for gi, g in enumerate(genres):
        for k in range(per_genre):
            name = f"{g}.{k:05d}.{ext}"
            if layout == "original":
                folder = root / "genres" / g
            elif layout == "kaggle":
                folder = root / "Data" / "genres_original" / g
            else:
                folder = root
            folder.mkdir(parents=True, exist_ok=True)
            fmt = "AU" if ext == "au" else None
            import soundfile as sf
            sf.write(str(folder / name), tone(seconds, 22050, 200.0 * (gi + 1) + 30 * k), 22050,
                     format=fmt, subtype="PCM_16")
    return root


@pytest.mark.parametrize("layout,ext", [("original", "au"), ("kaggle", "wav"), ("flat", "wav")])
def test_discovery_of_the_usual_layouts(tmp_path, layout, ext):
    tracks = discover(make_gtzan(tmp_path, layout, ext=ext))
    assert [t.genre for t in tracks] == ["blues"] * 2 + ["classical"] * 2 + ["country"] * 2
    assert [t.label for t in tracks] == [0, 0, 1, 1, 2, 2]
    assert tracks[0].track_id == f"blues/blues.00000.{ext}"


def test_discovery_errors(tmp_path):
    with pytest.raises(GTZANError, match="not found"):
        discover(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GTZANError, match="empty"):
        discover(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "song.mp3").write_bytes(b"x")
    with pytest.raises(GTZANError, match="no GTZAN tracks found.*genres_original"):
        discover(tmp_path / "other")


def test_stratified_split_is_seeded_and_stratified():
    labels = np.repeat(np.arange(10), 100)
    a, b, c = (stratified_split(labels, s) for s in (0, 0, 1))
    assert all(np.array_equal(a[k], b[k]) for k in a) and not np.array_equal(a["test"], c["test"])
    assert sorted(np.concatenate(list(a.values()))) == list(range(1000))
    for name, frac in (("train", 72), ("val", 18), ("test", 10)):
        assert np.all(np.bincount(labels[a[name]], minlength=10) == frac)


def test_token_files_round_trip_and_refuse_bad_ones(tmp_path):
    ts = pack([np.ones((3, 4)), 2 * np.ones((5, 4))], [1, 2], ["a", "b"], GENRES, metadata={"k": 1})
    save_tokens(tmp_path / "t.npz", ts)
    back = load_tokens(tmp_path / "t.npz")
    assert back.X.shape == (2, 5, 4) and list(back.lengths) == [3, 5] and back.metadata == {"k": 1}
    assert back.genres == GENRES and list(back.ids) == ["a", "b"]
    np.savez(tmp_path / "nolabels.npz", X=np.zeros((2, 3, 4)))
    with pytest.raises(TokenFileError, match="no labels"):
        load_tokens(tmp_path / "nolabels.npz")
    np.savez(tmp_path / "flat.npz", X=np.zeros((2, 4)), labels=np.zeros(2, dtype=int))
    with pytest.raises(TokenFileError, match=r"\(N, T, D\)"):
        load_tokens(tmp_path / "flat.npz")
    np.savez(tmp_path / "count.npz", X=np.zeros((2, 3, 4)), labels=np.zeros(3, dtype=int))
    with pytest.raises(TokenFileError, match="entries"):
        load_tokens(tmp_path / "count.npz")
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(TokenFileError, match="not a readable"):
        load_tokens(tmp_path / "junk.npz")
    with pytest.raises(TokenFileError, match="not found"):
        load_tokens(tmp_path / "none.npz")


def interrupt_extraction(root, out, embedder, monkeypatch, at_call):
    """Extract ``root`` into ``out`` with Ctrl-C at the ``at_call``-th track (the tracks before
    it are kept as parts); returns the front end, whose tracks are read normally again."""
    from audio.frontends import as_frontend
    frontend = as_frontend(embedder)
    real, calls = frontend.file_tokens, []

    def interrupted(path, *a, **k):
        calls.append(path)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return real(path, *a, **k)
    with monkeypatch.context() as patch:
        patch.setattr(frontend, "file_tokens", interrupted)
        with pytest.raises(KeyboardInterrupt):
            extract_gtzan(root, out, frontend, log=lambda s: None)
    return frontend


def test_extract_is_resumable_and_skips_corrupt_files(tmp_path, monkeypatch):
    root = make_gtzan(tmp_path / "g", "original", per_genre=2, ext="wav")
    (root / "genres" / "blues" / "blues.00009.wav").write_text("corrupt")
    embedder = build_embedder(random_seed=0)
    full = extract_gtzan(root, tmp_path / "full.npz", embedder, log=lambda s: None)
    assert full.X.shape == (6, 5, 128) and list(full.lengths) == [5] * 6
    assert [s["id"] for s in full.metadata["skipped"]] == ["blues/blues.00009.wav"]
    assert full.metadata["vggish"] == "random-0" and full.metadata["frontend"]["hop"] == 4000

    frontend = interrupt_extraction(root, tmp_path / "part.npz", embedder, monkeypatch, at_call=4)
    assert not (tmp_path / "part.npz").exists()
    assert len(list((tmp_path / "part.npz.parts").glob("*.npy"))) == 2     # tracks 1-2 kept
    resumed = extract_gtzan(root, tmp_path / "part.npz", frontend, log=lambda s: None)
    assert not (tmp_path / "part.npz.parts").exists()
    np.testing.assert_array_equal(resumed.X, full.X)
    assert list(resumed.ids) == list(full.ids)
    other = build_embedder(random_seed=1)
    (tmp_path / "x.npz.parts").mkdir()
    (tmp_path / "x.npz.parts" / "manifest.json").write_text(json.dumps({"tracks": []}))
    with pytest.raises(TokenFileError, match="partial extraction"):
        extract_gtzan(root, tmp_path / "x.npz", other, log=lambda s: None)


def test_extract_real_gtzan_excerpts(shared_data, tmp_path):
    folder = tmp_path / "gtzan"
    folder.mkdir()
    for g in ("jazz", "metal"):
        src = shared_data / "gtzan_excerpts" / f"{g}.00000.wav"
        (folder / src.name).symlink_to(src)
    tokens = extract_gtzan(folder, tmp_path / "t.npz", build_embedder(random_seed=0), log=lambda s: None)
    assert len(tokens.labels) == 2 and list(tokens.labels) == [5, 6]
    assert 60 <= tokens.lengths.min() and tokens.X.shape[2] == 128


def test_musicnn_converter(shared_data, tmp_path):
    tokens = convert_musicnn(shared_data / "gtzan_musicnn_tokens")
    assert isinstance(tokens, TokenSet)
    assert (tokens.split == "train").sum() == 443 and (tokens.split == "test").sum() == 290
    assert tokens.X.shape[1:] == (29, 50) and set(tokens.lengths) <= {28, 29}
    for i in range(0, len(tokens.ids), 37):
        assert GENRES[tokens.labels[i]] == tokens.ids[i].split("/")[0]
    save_tokens(tmp_path / "m.npz", tokens)
    assert load_tokens(tmp_path / "m.npz").X.shape == tokens.X.shape


def test_extract_cli(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    make_gtzan(tmp_path / "g", "kaggle", per_genre=1, seconds=0.6)
    r = subprocess.run([sys.executable, str(root / "main.py"), "extract", "--gtzan", str(tmp_path / "g"),
                        "--random-vggish", "--out", str(tmp_path / "t.npz")],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    assert "[3/3]" in r.stderr and load_tokens(tmp_path / "t.npz").X.shape == (3, 2, 128)
    before = (tmp_path / "t.npz").stat().st_mtime_ns
    again = [sys.executable, str(root / "main.py"), "extract", "--gtzan", str(tmp_path / "g"),
             "--random-vggish", "--vggish-seed", "1", "--out", str(tmp_path / "t.npz")]
    r = subprocess.run(again, capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 1 and "t.npz exists; give --force" in r.stderr
    assert (tmp_path / "t.npz").stat().st_mtime_ns == before                    # kept
    r = subprocess.run(again + ["--force"], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    assert load_tokens(tmp_path / "t.npz").metadata["vggish"] == "random-1"       # replaced
    r = subprocess.run([sys.executable, str(root / "main.py"), "extract", "--gtzan",
                        str(tmp_path / "missing"), "--random-vggish", "--out", str(tmp_path / "u.npz")],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 1 and "GTZAN folder not found" in r.stderr
