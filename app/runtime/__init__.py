"""The Qt-free runtime that the CLI, the window and the tests drive the same way: the streaming
engine, its step records and their CSV/JSON forms, the model line-up, sources and front ends
chosen from arguments."""
