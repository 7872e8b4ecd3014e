"""The engine (app/runtime/engine.py) over a dict of models, as the tests build it."""
from app.runtime.engine import Engine
from app.runtime.lineup import Entry
from audio.gtzan import GENRES


def engine_of(frontend, models: dict, *, trained=None, spacing=None, frontends=None, classes=None, **kw) -> Engine:
    """An engine running ``models`` (name -> model), untrained unless ``trained`` says, each fed
    every hop unless ``spacing`` says."""
    entries = [Entry(name, model, (trained or {}).get(name, False), (spacing or {}).get(name, 1),
                     (frontends or {}).get(name), classes=tuple((classes or {}).get(name) or GENRES))
               for name, model in models.items()]
    return Engine(frontend, entries, **kw)
