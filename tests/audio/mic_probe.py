"""Child process for the microphone tests: capture from a PortAudio input, report JSON lines.

Run in its own process so that it imports sounddevice after the test's JACK server is up, and so
that PortAudio's JACK teardown (which asserts when the server has vanished) cannot take the test
runner down with it.  Usage: python mic_probe.py MODE DEVICE HOPS  (MODE: capture|lost|slow|engine;
engine: the window's engine process opens the microphone and streams the musicnn front end)
"""
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from audio.errors import AudioError, DeviceLostError  # noqa: E402
from audio.sources import MicrophoneSource  # noqa: E402


def say(**kw):
    print(json.dumps(kw), flush=True)


def main(mode: str, device: str, hops: int) -> None:
    try:
        mic = MicrophoneSource(device, lost_after=1.5,
                               max_queued_hops=2 if mode == "slow" else 16).start()
    except AudioError as e:
        say(event="error", type=type(e).__name__, message=str(e))
        return
    say(event="started", rate=mic.input_rate)
    got, times = [], []
    t_lost = None
    try:
        for hop in mic:
            got.append(hop)
            times.append(time.monotonic())
            say(event="hop", n=len(got))
            if mode == "slow":
                time.sleep(0.6)
            if len(got) >= hops:
                break
            if mode == "lost" and t_lost is None and len(got) == 3:
                t_lost = time.monotonic()
    except DeviceLostError as e:
        say(event="lost", message=str(e), hops=len(got))
        return
    t0 = time.monotonic()
    mic.close()
    close_s = time.monotonic() - t0
    audio = np.concatenate(got[4:]) if len(got) > 4 else np.concatenate(got)
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    rate_hz = (len(times) - 5) / (times[-1] - times[4]) if len(times) > 5 else 0.0
    say(event="done", hops=len(got), rate_hz=rate_hz, close_s=close_s,
        freq=float(np.fft.rfftfreq(len(audio), 1 / 16000)[spectrum.argmax()]),
        peak=float(np.abs(audio).max()), dropped=mic.stats.dropped,
        shapes_ok=all(h.shape == (4000,) and h.dtype == np.float32 for h in got))


def engine(device: str, hops: int) -> None:
    """The window's path: an EngineProcess opens the microphone in its own process."""
    from app.runtime.engine_process import EngineProcess
    from app.runtime.frontend_args import FrontEndSpec
    from app.runtime.sources import SourceKind, SourceSpec
    e = EngineProcess()
    try:
        e.start_run(FrontEndSpec("musicnn"), SourceSpec(SourceKind.MIC, device), [])
        steps, deadline = [], time.monotonic() + 60
        while len(steps) < hops and time.monotonic() < deadline:
            for kind, *rest in e.poll():
                if kind == "ready":
                    say(event="started", rate=0)
                elif kind == "step":
                    steps.append(rest[0])
                    say(event="hop", n=len(steps))
                elif kind in ("error", "died"):
                    say(event="error", type=kind, message=rest[0])
                    return
            time.sleep(0.02)
        late = steps[4:]
        mel = np.concatenate([s.mel for s in late])
        say(event="done", hops=len(steps), source=steps[-1].source, input_rate=steps[-1].input_rate,
            rate_hz=(len(late) - 1) / (late[-1].ready_time - late[0].ready_time),
            band=int(mel.mean(axis=0).argmax()), engine_pid=e.process.pid, probe_pid=os.getpid())
    finally:
        e.close()


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        engine(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
