"""Errors a user can cause in the audio layer. Each message says what went wrong; ``hint`` says
what to do next in the window (the CLI's messages already name the option to use)."""


class AudioError(Exception):
    """Base class: anything wrong with an audio source or the embedding model. The message is
    made printable: a file name that is not UTF-8 shows its bytes as ``\\xff``, control
    characters as escapes, so it prints, logs and saves anywhere."""
    hint = ""

    def __init__(self, *args):
        super().__init__(*(printable(a) if isinstance(a, str) else a for a in args))


def printable(text: str) -> str:
    """``text`` with undecodable bytes (surrogates) and control characters as backslash escapes."""
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class AudioFileError(AudioError):
    """A file that is missing, empty, unreadable, corrupt or not audio."""
    hint = "Choose another file and press Start."


class AudioDeviceError(AudioError):
    """No input device, an unknown device, a device that cannot open, or PortAudio missing."""
    hint = ("Choose another input device (Rescan devices), or the demo signal or a file, "
            "and press Start.")


class DeviceLostError(AudioDeviceError):
    """The input device stopped delivering audio mid-stream (unplugged, server gone)."""


class VGGishWeightsError(AudioError):
    """VGGish weights missing, unreadable, or not a VGGish state dict."""
    hint = ("Put vggish-10086976.pth in the torch hub cache or pass --vggish-weights FILE, or "
            "choose the musicnn front end, whose weights ship.")


class MusicnnWeightsError(AudioError):
    """The musicnn package (its pretrained checkpoint files) missing, unreadable or corrupt."""
    hint = "Run `make setup` (it installs musicnn==0.1.0 --no-deps), or choose the VGGish front end."


class PrecisionError(AudioError):
    """A precision the front end or this hardware cannot run (audio/musicnn: ``precision_problem``)."""
    hint = "Choose precision float32, which runs everywhere."


class FrontEndMismatchError(AudioError):
    """A model trained on tokens of one front end was asked to run on another's."""
    hint = "Choose the front end the model was trained on under Front end."


def with_hint(e: BaseException) -> str:
    """The error's message followed by its hint, if it has one."""
    hint = getattr(e, "hint", "")
    return f"{e} {hint}".strip() if hint and hint not in str(e) else str(e)
