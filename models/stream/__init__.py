"""A model's streaming step as a pure function of explicit state, and what it serves: the ONNX
export (app/offline/onnx_export.py) and many streams stepped as one batch (``batch``).

- ``graph``: the step of continual SDA (single-output, retroactive) and of continual Nyström with
  fixed landmarks, and the helpers every graph shares (ring writes, running sums, events);
- ``graph_landmarks``: continual Nyström with continual landmarks;
- ``two_block``: the 2-block step, ``stream_graph(model)`` (the graph of a model) and
  ``state_spec_for`` (the state a file of a config must declare);
- ``batch``: ``StreamBatch``, slots of streams of one model stepped together.
"""
