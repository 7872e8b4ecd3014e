"""A model's streaming step, written once: a pure function of explicit, typed state, batched
along a leading stream axis (one stream is a batch of one). What the model's ``step()``, many
streams in one batch, the ONNX export and CUDA graph capture all run; the compiled CPU backend
(models/fused/) takes the same state arrays.

- ``ops``: state specs, per-stream masks, rare events as branches (eager, torch.cond, masked);
- ``sums``: the numerically stable running softmax sums (and ``Stability``);
- ``continual``: continual SDA, single-output and retroactive, and their state;
- ``nystrom``: continual Nyström with fixed or continual landmarks, and its state;
- ``window``: the second block of a 2-block model, over the window the first gives;
- ``model``: the whole step of a continual model (``ModelStep``), its state spec;
- ``batch``: ``StreamBatch``, slots of streams of one model stepped together: the one holder
  of streaming state (a model's ``reset``/``step`` run a batch of its streams).
"""
