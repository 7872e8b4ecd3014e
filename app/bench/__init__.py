"""`bench`: each kind of run in its own module (steps, attention, control, onnx, scale, streams,
serve), their timing helpers, and the page they write."""
