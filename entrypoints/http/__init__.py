"""OpenAI-compatible HTTP frontends of the engine (FastAPI + uvicorn).

* :mod:`entrypoints.http.app`: the ASGI app and its routes over an ``engine.interface.Engine``
  (``AsyncEngine`` in process, ``ipc.EngineClient`` in a frontend process);
* :mod:`entrypoints.http.context`: ``Frontend``, what the routes share (engine, limits, metrics,
  health); :mod:`entrypoints.http.serving`: one generation request, JSON or SSE;
* :mod:`entrypoints.http.protocol`: request/response bodies, strict and bounded;
  :mod:`entrypoints.http.errors`: every error in OpenAI's shape;
* :mod:`entrypoints.http.limits`, :mod:`entrypoints.http.guards`, :mod:`entrypoints.http.server`:
  the limits, the ASGI guards (body size/time, requests in flight), hardened uvicorn (head
  timeout, connection cap, log-flood filter);
* :mod:`entrypoints.http.frontend`: the frontend process (``enginecore serve --http``) and the
  engine process's supervisor of its frontends; :mod:`entrypoints.http.metrics`: Prometheus
  (the engine's figures: :mod:`entrypoints.http.engine_metrics`; vLLM's names for all of them:
  :mod:`entrypoints.http.vllm_names`).
"""


def __getattr__(name: str):  # lazy: the engine process imports .frontend without FastAPI
    if name == "create_app":
        from . import app

        return app.create_app
    raise AttributeError(name)


__all__ = ["create_app"]
