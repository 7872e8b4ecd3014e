"""`python main.py bench --gui SECONDS` and `bench --evaluate`: the live app and the evaluation
mode, measured.

GUI: the real window (offscreen unless a display is set) on the real-time demo signal with six
models (the four variants, continual Nyström with fixed landmarks, and a 2-block continual
Nyström), VGGish on every hop. Prints the GUI thread's frame time, the end-to-end delay from a
hop's last sample to its drawn result (median/p95), the real-time factor and dropped hops.

Evaluate: 300 synthetic sequences x 120 steps x 6 checkpoints streamed by `evaluate`, timed.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np
import torch


def _pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1)))] if v else float("nan")


def gui(seconds: float, vggish_weights: str | None = None) -> dict:
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from app.gui.window import MainWindow, Options
    from models.transformer import ModelConfig, build_model

    app = QApplication.instance() or QApplication([])
    settings = QSettings(os.path.join(tempfile.mkdtemp(), "bench.ini"), QSettings.IniFormat)
    w = MainWindow(Options(source="demo", variants=["regular", "continual", "nystrom", "continual_nystrom"],
                           vggish_weights=vggish_weights, random_vggish=None if vggish_weights else 0,
                           autostart=False), settings)
    w.show()
    w.start()
    torch.manual_seed(0)
    w.engine.add_model("continual_nystrom 2-block", build_model(ModelConfig(variant="continual_nystrom", layers=2)))
    fixed = build_model(ModelConfig(variant="continual_nystrom"))
    w.engine.add_model("continual_nystrom fixed", fixed)
    QTimer.singleShot(5000, lambda: w.engine.set_landmark_mode("continual_nystrom fixed", "fixed"))
    QTimer.singleShot(int(seconds * 1000), app.quit)
    t0 = time.monotonic()
    app.exec()
    wall = time.monotonic() - t0
    history = list(w.history)
    steady = history[20:] or history           # after start-up (model adds, landmark fit)
    proc = [sum(r.latency_ms.values()) for r in steady]
    source = w.runner.worker.source if w.runner else None
    result = {
        "seconds": wall, "hops": len(history), "models": len(history[-1].probabilities) if history else 0,
        "frame_ms_median": statistics.median(w.frame_ms), "frame_ms_p95": _pct(w.frame_ms, 0.95),
        "frame_ms_max": max(w.frame_ms),
        "delay_ms_median": statistics.median(list(w.delay_ms)[20:] or w.delay_ms),
        "delay_ms_p95": _pct(list(w.delay_ms)[20:] or w.delay_ms, 0.95),
        "rtf": statistics.fmean(proc) / 250.0,
        "dropped_hops": source.stats.dropped if source else history[-1].dropped_hops,
        "vggish": history[-1].vggish if history else "",
    }
    w.close()
    w.deleteLater()
    app.processEvents()
    return result


def evaluate_speed(sequences: int = 300, steps: int = 120) -> dict:
    from app.evaluate import evaluate
    from app.train import TrainConfig, train
    from audio.gtzan import GENRES
    from audio.token_cache import pack, save_tokens
    from models.checkpoint import save_checkpoint
    from models.transformer import ModelConfig

    folder = tempfile.mkdtemp()
    g = np.random.default_rng(0)
    labels = np.arange(sequences * 2) % 10
    seqs = [g.normal(size=(steps, 128)).astype(np.float32) + 0.5 * (np.arange(128) % 10 == c)
            for c in labels]
    split = np.array(["train"] * sequences + ["test"] * sequences)
    tokens = pack(seqs, labels, [f"s{i}" for i in range(len(seqs))], GENRES, split)
    path = os.path.join(folder, "tokens.npz")
    save_tokens(path, tokens)
    ckpts = []
    for variant, mode in (("regular", None), ("continual", None), ("nystrom", None),
                          ("continual_nystrom", None), ("continual_nystrom", "fixed")):
        cfg = ModelConfig(variant=variant, window=steps, landmark_mode=mode)
        model, meta = train(tokens, cfg, TrainConfig(epochs=1, kmeans_tokens=5000), log=lambda s: None)
        ckpts.append(os.path.join(folder, f"{variant}-{mode}.pt"))
        save_checkpoint(model, ckpts[-1], classes=list(GENRES), metadata=meta)
    cfg = ModelConfig(variant="continual", window=steps, layers=2)
    model, meta = train(tokens, cfg, TrainConfig(epochs=1), log=lambda s: None)
    ckpts.append(os.path.join(folder, "continual2.pt"))
    save_checkpoint(model, ckpts[-1], classes=list(GENRES), metadata=meta)
    t0 = time.monotonic()
    evaluate(path, ckpts, log=lambda s: None)
    return {"sequences": sequences, "steps": steps, "models": len(ckpts), "seconds": time.monotonic() - t0,
            "threads": torch.get_num_threads()}


def main(gui_seconds: float | None, eval_speed: bool, vggish_weights: str | None = None) -> int:
    if eval_speed:
        r = evaluate_speed()
        print(f"evaluate: {r['sequences']} sequences x {r['steps']} steps x {r['models']} models streamed, "
              f"with batch-forward agreement and cost streams, in {r['seconds']:.1f} s "
              f"({r['threads']} threads; goal < 120 s)")
    if gui_seconds:
        r = gui(gui_seconds, vggish_weights)
        print(f"GUI, {r['models']} models on the real-time demo signal for {r['seconds']:.0f} s "
              f"({r['hops']} hops, {r['vggish']}):")
        print(f"  GUI-thread frame time: median {r['frame_ms_median']:.1f} ms, p95 {r['frame_ms_p95']:.1f} ms, "
              f"max {r['frame_ms_max']:.1f} ms")
        print(f"  end-to-end delay, hop's last sample -> drawn: median {r['delay_ms_median']:.0f} ms, "
              f"p95 {r['delay_ms_p95']:.0f} ms (goal <= 100 ms)")
        print(f"  real-time factor {r['rtf']:.2f}; dropped hops {r['dropped_hops']}")
    return 0
