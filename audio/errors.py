"""Errors a user can cause in the audio layer. Each message says what to do."""


class AudioError(Exception):
    """Base class: anything wrong with an audio source or the embedding model."""


class AudioFileError(AudioError):
    """A file that is missing, empty, unreadable, corrupt or not audio."""


class AudioDeviceError(AudioError):
    """No input device, an unknown device, a device that cannot open, or PortAudio missing."""


class DeviceLostError(AudioDeviceError):
    """The input device stopped delivering audio mid-stream (unplugged, server gone)."""


class VGGishWeightsError(AudioError):
    """VGGish weights missing, unreadable, or not a VGGish state dict."""


class MusicnnWeightsError(AudioError):
    """The musicnn package (its pretrained checkpoint files) missing, unreadable or corrupt."""


class FrontEndMismatchError(AudioError):
    """A model trained on tokens of one front end was asked to run on another's."""
