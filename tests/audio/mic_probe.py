"""Child process for the microphone tests: capture from a PortAudio input, report JSON lines.

Run in its own process so that it imports sounddevice after the test's JACK server is up, and so
that PortAudio's JACK teardown (which asserts when the server has vanished) cannot take the test
runner down with it.  Usage: python mic_probe.py MODE DEVICE HOPS  (MODE: capture|lost|slow)
"""
import json
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
