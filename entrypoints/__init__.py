"""The process entry points, above every library layer: the ``enginecore`` CLI (with ``serve``,
the only code that installs signal handlers), ``serve``, and the OpenAI-compatible HTTP frontends.

Layers read top-down: ``states`` <- ``engine`` <- ``ipc`` <- ``entrypoints``.
"""
