"""OpenAI-compatible HTTP frontends of the engine (FastAPI + uvicorn).

* :mod:`entrypoints.http.app`: the ASGI app over an engine-like object (``AsyncEngine`` in process,
  ``ipc.EngineClient`` in a frontend process);
* :mod:`entrypoints.http.frontend`: the frontend process (``enginecore serve --http``) and the engine
  process's supervisor of its frontends;
* :mod:`entrypoints.http.protocol`, :mod:`entrypoints.http.metrics`: request/response bodies, Prometheus.
"""



def __getattr__(name: str):  # lazy: the engine process imports .frontend without FastAPI
    if name in ("create_app", "EngineHandle"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)


__all__ = ["create_app", "EngineHandle"]
