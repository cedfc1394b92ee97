"""``enginecore`` command line: ``generate`` (in-process or over IPC) and ``serve``.

This module is the process entry point; it alone may install signal handlers: ``main`` first of
all (``startup_signals``: a signal while torch and the engine are still being imported exits
128+N), then ``serve``. So that nothing runs before that, this module imports only the standard
library at its top; everything else is imported inside the functions.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import startup_signals


def _sampling_from_args(a: argparse.Namespace):
    from engine.params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, seed=a.seed, stop=a.stop or []).validate()


async def _generate(a: argparse.Namespace) -> int:
    from .args import config_from_args, token_from_args

    params = _sampling_from_args(a)
    if a.connect:
        from ipc.client import EngineClient

        connected = False
        try:
            token = token_from_args(a)
            async with EngineClient.connect(a.connect, token=token, client_name="enginecore-cli") as eng:
                connected = True
                prompt = a.prompt
                if a.chat:  # rendered here, with the template the engine sent in its handshake
                    prompt = await eng.apply_chat_template([{"role": "user", "content": a.prompt}])
                sys.stdout.write(a.prompt if not a.chat else "")
                async for out in eng.generate(prompt, params):
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
        except (OSError, ValueError, TimeoutError) as exc:
            if connected:
                raise
            print(f"enginecore: cannot connect to {a.connect}: {exc}", file=sys.stderr)
            return 2
    else:
        from engine.serving.async_engine import AsyncEngine

        async with AsyncEngine.open(config_from_args(a)) as eng:
            prompt = a.prompt
            if a.chat:
                prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
            sys.stdout.write(a.prompt if not a.chat else "")
            async for out in eng.generate(prompt, params):
                sys.stdout.write(out.text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .args import add_listen_args, add_model_args, add_ops_args, add_token_args
    from .logs import add_log_args

    ap = argparse.ArgumentParser(prog="enginecore", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream one completion")
    g.add_argument("prompt")
    add_model_args(g)
    g.add_argument("--connect", default=None, help="unix:///path or tcp://host:port of a running engine")
    add_token_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    add_log_args(g, default_level="warning")

    s = sub.add_parser("serve", help="run an engine process (IPC, optionally HTTP frontends)")
    add_model_args(s)
    s.add_argument("--listen", default=None, help="unix:///path (default) or tcp://127.0.0.1:PORT")
    add_token_args(s)
    add_listen_args(s)
    s.add_argument("--drain-timeout", type=float, default=30.0)
    s.add_argument("--http", default=None, help="HOST:PORT for the OpenAI-compatible frontends")
    s.add_argument("--api-servers", type=int, default=None,
                   help="HTTP frontend processes sharing the --http socket (default: on an "
                        "accelerator one per 4 CPUs this process may use, 1 to 4; on the CPU 1)")
    s.add_argument("--enable-sleep-mode", action="store_true",
                   help="HTTP admin endpoints /sleep, /wake_up, /update_weights, /is_sleeping "
                        "(they need the token if one is set; a non-loopback --http needs one). "
                        "Over IPC, sleep mode is always available")
    from .http.limits import add_http_limit_args

    add_http_limit_args(s)  # --max-body-bytes, --header-timeout, ...: see entrypoints/http/limits.py
    add_ops_args(s)  # --served-model-name, --disable-log-stats, --log-stats-interval
    add_log_args(s)
    s.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    s.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)

    return ap


def main(argv: list[str] | None = None) -> int:
    startup_signals.install()  # before any heavy import: SIGTERM now exits 143, not -15
    return _main(argv)


def _main(argv: list[str] | None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "generate":
        startup_signals.restore()  # not the engine process: Python's defaults (-15, 130)
    if a.verbose:
        a.log_level = "debug"
    from .logs import configure

    configure(a.log_level, a.log_format)  # the entry point owns the process's logging
    import anyio

    from engine.errors import EngineError

    # (glibc's malloc keeps its defaults here: entrypoints/malloc.py says why)
    if a.cmd == "serve" or not a.connect:  # this process runs the engine
        from engine.serving.cpu_threads import adaptive_ceiling, apply_threads

        # the default count (no --threads, no $OMP_NUM_THREADS) then follows the machine: a CPU
        # engine uses up to every CPU while other processes leave them free (ThreadGovernor)
        a.cpu_threads_max = adaptive_ceiling() if a.threads is None else None
        try:
            apply_threads(a.threads)
        except ValueError as exc:
            print(f"enginecore: bad configuration: {exc}", file=sys.stderr)
            return 2

    try:
        if a.cmd == "generate":
            return anyio.run(_generate, a)
        from .serve import serve_main

        startup_signals.defer()  # imported: from here a signal is recorded for serve.run
        code = serve_main(a)
        # NOTE: by now every device tensor is released, every client has its terminal output
        # and the socket is gone. Interpreter teardown with torch loaded took 1-2 s here and
        # does nothing an operator needs, so the engine process leaves at once.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    except EngineError as exc:
        print(f"enginecore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
