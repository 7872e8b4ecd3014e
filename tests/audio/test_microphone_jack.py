"""The microphone path for real: PortAudio capturing from a JACK dummy server fed by jack_metro.

Each scenario runs tests/audio/mic_probe.py in a child process (see its docstring). Skips with a reason
where jackd or PortAudio is not installed (CI installs both: scripts/system-deps.sh --test).
"""
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

PROBE = Path(__file__).with_name("mic_probe.py")
pytestmark = pytest.mark.skipif(shutil.which("jackd") is None or shutil.which("jack_metro") is None,
                                reason="JACK (jackd2) is not installed")


def portaudio_available() -> bool:
    """Whether the PortAudio library is installed. Looked up, not initialised: importing
    sounddevice initialises PortAudio, which probes JACK, and can fail while a previous test's
    server is shutting down (that is not a missing library)."""
    import ctypes.util
    return ctypes.util.find_library("portaudio") is not None


class Jack:
    """A JACK dummy server at ``rate`` with a 440 Hz metronome tone (jack_metro)."""

    count = 0

    def __init__(self, rate: int):
        self.rate = rate
        # a server of its own name: nothing a previous test's server left behind (its registry,
        # semaphores) is ever reused
        Jack.count += 1
        name = f"nystream-{os.getpid()}-{Jack.count}"
        self.env = {**os.environ, "JACK_NO_AUDIO_RESERVATION": "1", "JACK_NO_START_SERVER": "1",
                    "JACK_DEFAULT_SERVER": name}
        self.procs = []
        # a 5 s client timeout: on a loaded host a slow client is late, not removed from the graph
        self.jackd = self._spawn(["jackd", "-n", name, "--no-realtime", "-t", "5000", "-d", "dummy", "-r", str(rate),
                                  "-p", str(rate // 10)])
        if not self._wait_for_port("system:capture"):
            self.stop()
            pytest.skip("jackd did not start")
        beat = 600                                     # 100 ms beats, 90 ms tones: ~continuous
        self._spawn(["jack_metro", "-n", "metro", "-b", str(beat), "-f", "440", "-A", "0.5", "-D", "90"])
        assert self._wait_for_port("metro:"), "jack_metro did not start"

    def _spawn(self, cmd):
        p = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def ports(self):
        r = subprocess.run(["jack_lsp"], env=self.env, capture_output=True, text=True, timeout=10)
        return r.stdout.split()

    def _wait_for_port(self, prefix, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for p in self.ports() if p.startswith(prefix)]
            if found:
                return found
            time.sleep(0.1)
        return []

    def feed_tone_into_portaudio(self):
        inputs = self._wait_for_port("PortAudio:in")
        assert inputs, f"PortAudio's input ports never appeared: {self.ports()}"
        metro = self._wait_for_port("metro:")[0]
        for port in inputs:   # a port listed twice (or connected already) is connected once
            r = subprocess.run(["jack_connect", metro, port], env=self.env, timeout=10,
                               capture_output=True, text=True)
            assert r.returncode == 0 or "already connected" in r.stderr, (port, r.stderr)

    def stop(self):
        """End the clients, then the server: asked first (it removes its shared state), killed
        if it does not go within 5 s."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)


def jack_at(rate: int):
    if not portaudio_available():
        pytest.skip("PortAudio (libportaudio2) is not installed")
    server = Jack(rate)
    yield server
    server.stop()


@pytest.fixture(params=[16000, 48000], ids=["16kHz", "48kHz"])
def jack(request):
    """At the model's rate (no resampling) and at a sound card's (resampled): for what the
    audio itself goes through."""
    yield from jack_at(request.param)


@pytest.fixture
def jack48():
    """At a sound card's rate only: for what does not depend on the rate (a device lost, hops
    dropped, a device not there)."""
    yield from jack_at(48000)


def run_probe(jack, mode, hops, on_started=None, on_hop=None, timeout=30):
    """The probe's events (JSON lines) until it is done; a probe that ends without one fails
    the test with its stderr."""
    child = subprocess.Popen([sys.executable, str(PROBE), mode, "system", str(hops)], env=jack.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([child.stdout], [], [], 0.2)
            if not ready:
                if child.poll() is not None:
                    break
                continue
            line = child.stdout.readline()
            if not line:
                break
            event = json.loads(line)
            event["received"] = time.monotonic()
            events.append(event)
            if event["event"] == "started" and on_started:
                on_started()
            if event["event"] == "hop" and on_hop:
                on_hop(event["n"])
            if event["event"] in ("done", "lost", "error"):
                break
        else:
            raise AssertionError(f"the capture process hung; events so far: {events[-3:]}")
    finally:
        try:
            child.wait(timeout=3)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if not events or events[-1]["event"] not in ("done", "lost", "error"):
        raise AssertionError(f"the capture process ended (code {child.returncode}) after "
                             f"{events[-3:]}: {child.stderr.read()[-1500:]}")
    return events, child.returncode


def test_microphone_delivers_the_tone_at_4_hz_and_stops_promptly(jack):
    events, code = run_probe(jack, "capture", 16, on_started=jack.feed_tone_into_portaudio)
    started, done = events[0], events[-1]
    assert started["event"] == "started" and started["rate"] in (16000, 48000)
    assert done["event"] == "done", events[-3:]
    assert done["shapes_ok"] and done["hops"] == 16
    assert 3.0 < done["rate_hz"] < 5.5, done
    assert done["peak"] > 0.05 and abs(done["freq"] - 440.0) < 5.0, done
    assert done["close_s"] < 1.0        # close() gives up waiting on PortAudio after 0.5 s
    assert code == 0


def test_the_window_engine_process_opens_the_microphone_and_streams_it(jack):
    """The window's engine runs in a process of its own, which opens the microphone itself."""
    import librosa
    events, _ = run_probe(jack, "engine", 14, on_started=jack.feed_tone_into_portaudio, timeout=120)
    done = events[-1]
    assert done["event"] == "done", events[-3:]
    assert done["engine_pid"] != done["probe_pid"] and done["source"].startswith("mic:")
    assert done["hops"] == 14 and done["input_rate"] == jack.rate
    assert 3.0 < done["rate_hz"] < 5.0                      # the sound card's clock: 4 hops a second
    centres = librosa.mel_frequencies(n_mels=96 + 2, fmin=0.0, fmax=8000.0)[1:-1]
    assert abs(done["band"] - int(np.abs(centres - 440).argmin())) <= 1   # the 440 Hz tone's band


def test_device_disappearing_mid_stream_is_a_clear_error_not_a_hang(jack48):
    t_kill = []

    def kill_server(n):
        if n == 3 and not t_kill:
            t_kill.append(time.monotonic())
            jack48.stop()
    events, code = run_probe(jack48, "lost", 100, on_started=jack48.feed_tone_into_portaudio,
                             on_hop=kill_server)
    last = events[-1]
    assert last["event"] == "lost", events[-3:]
    assert "stopped delivering audio" in last["message"]
    assert last["received"] - t_kill[0] < 5.0


def test_slow_consumer_drops_whole_hops_and_counts_them(jack48):
    events, code = run_probe(jack48, "slow", 6, on_started=jack48.feed_tone_into_portaudio)
    done = events[-1]
    assert done["event"] == "done" and done["dropped"] >= 2, done


def test_unknown_device_is_refused_with_the_list(jack48):
    child = subprocess.run([sys.executable, str(PROBE), "capture", "no such mic", "1"], env=jack48.env,
                           capture_output=True, text=True, timeout=30)
    assert child.stdout, f"the probe ended (code {child.returncode}) without a word: {child.stderr[-1500:]}"
    event = json.loads(child.stdout.splitlines()[0])
    assert event["event"] == "error" and event["type"] == "AudioDeviceError"
    assert "no input device named" in event["message"] and "system" in event["message"]


def test_no_audio_device_at_all_is_a_clear_error():
    """Without an audio server this machine has no input device (no sound card)."""
    if not portaudio_available():
        pytest.skip("PortAudio (libportaudio2) is not installed")
    env = {**os.environ, "JACK_NO_START_SERVER": "1"}
    code = ("from audio.sources import list_input_devices, MicrophoneSource\n"
            "from audio.errors import AudioDeviceError\n"
            "if list_input_devices():\n    print('HAS-DEVICES')\n"
            "else:\n    try:\n        MicrophoneSource()\n    except AudioDeviceError as e:\n"
            "        print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parents[2])
    if "HAS-DEVICES" in r.stdout:
        pytest.skip("this machine has an input device")
    assert r.stdout.startswith("ERR no audio input device found"), r.stdout + r.stderr
