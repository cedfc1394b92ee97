"""The grammar compile server (``engine/structured/compile_pool.py``, ``compile_worker.py``,
``compile_wire.py``): a compile comes back as the grammar an in-process compile gives; one past its
deadline is stopped (its process killed and reaped) and the next is forked from the same server;
the bound on compiles counts the processes that run; a compile finding no slot free within its
wait is told so; a compile process that dies is an error for its own request only, and a server
that dies for the compiles it ran (the next compile starts a new one); the server and its
compiles end with the engine's process, even mid-compile; close() leaves no process behind;
frames over their bound or not messages are refused.

The slow constraint is a JSON schema of strings with ``minLength`` ~1e6: with SmolLM2's vocabulary
xgrammar takes ~0.8 s a string (~35 s for 40 strings, measured), and cannot be interrupted."""

from __future__ import annotations

import os
from pathlib import Path
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

xgr = pytest.importorskip("xgrammar")

from engine.errors import BadRequestError, EngineError, EngineShutdownError  # noqa: E402
from engine.structured import compile_wire as wire  # noqa: E402
from engine.structured.compile_pool import (  # noqa: E402
    NICE, CompilePool, CompileTimeout, SlotTimeout)
from engine.structured.compiler import compile_constraint  # noqa: E402
from engine.structured.grammars import tokenizer_info  # noqa: E402
from engine.structured.spec import StructuredOutputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
          "required": ["name", "age"]}
SLOW = StructuredOutputs(json_schema={
    "type": "object", "properties": {f"p{i}": {"type": "string", "minLength": 999_999 + i}
                                     for i in range(40)}, "required": [f"p{i}" for i in range(40)]})


@pytest.fixture(scope="module")
def vocab():
    """(the default model's tokenizer, its vocabulary size, an in-process compiler)."""
    from engine.loader.checkpoint import resolve_source

    cfg, _, tok = resolve_source("default")
    info = tokenizer_info(tok, cfg.vocab_size)
    return tok, cfg.vocab_size, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _pool(vocab, workers: int) -> CompilePool:
    tok, n, _ = vocab
    return CompilePool(lambda: tokenizer_info(tok, n), workers)


def compile_processes(root: int | None = None) -> tuple[list[int], list[int]]:
    """(the live compile servers whose parent is ``root`` -- this process --, their live
    children: the compiles)."""
    root = os.getpid() if root is None else root
    procs = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            f = stat[stat.rindex(")") + 2:].split()
            if f[0] != "Z" and b"compile_worker" in cmd:
                procs[int(d.name)] = int(f[1])
    servers = sorted(p for p, parent in procs.items() if parent == root)
    return servers, sorted(p for p, parent in procs.items() if parent in servers)


def _niceness(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[16])


def _gone(pid: int) -> bool:
    """No such process, or a zombie (ended; its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


async def _until(cond, seconds: float = 120.0) -> None:
    with anyio.fail_after(seconds):
        while not cond():
            await anyio.sleep(0.02)


def test_a_compile_through_the_server_is_the_in_process_one_and_close_ends_it(vocab):
    """Also: a SIGTERM or SIGINT sent to the process group leaves the server and workers be."""
    pool = _pool(vocab, 2)
    c = StructuredOutputs(json_schema=SCHEMA)

    async def main():
        g, seconds = await pool.compile(c.kind, c.text, 60.0, 60.0)
        again, _ = await pool.compile("regex", r"(ab|cd){1,3}x", 60.0, 60.0)
        with pytest.raises(BadRequestError, match="the regex constraint does not compile: "
                                                  "Regex parsing error"):
            await pool.compile("regex", "(a", 60.0, 60.0)
        return g, seconds, again

    g, seconds, again = anyio.run(main)
    os.kill(pool.server_pid, signal.SIGTERM)  # the process group's: the engine's to act on
    os.kill(compile_processes()[1][0], signal.SIGINT)
    assert anyio.run(pool.compile, "regex", "[a-z]", 60.0, 60.0)[0] is not None
    want = compile_constraint(vocab[2], c.kind, c.text)
    assert g.serialize_json() == want.serialize_json() and seconds > 0
    m = xgr.GrammarMatcher(again)
    assert m.accept_string("abcdx") and not m.accept_string("a")  # the end of the regex
    server = pool.server_pid
    servers, workers = compile_processes()
    assert pool.started == 1 and servers == [server] and 1 <= len(workers) <= 2  # kept warm
    pool.close()
    assert _gone(server) and compile_processes() == ([], [])
    with pytest.raises(EngineShutdownError):
        anyio.run(pool.compile, "regex", "x", 10.0, 10.0)


def test_a_compile_past_its_deadline_is_killed_and_the_bound_counts_running_compiles(vocab):
    """One slot: a slow compile holds it until its deadline, then its process is killed; the
    compile waiting meanwhile runs next, forked from the same server. At no moment do two
    compile processes live."""
    pool = _pool(vocab, 1)
    seen: list[list[int]] = []
    out: dict = {}

    async def slow():
        try:
            await pool.compile(SLOW.kind, SLOW.text, 3.0, 300.0)
        except CompileTimeout:
            out["slow"] = "timeout"

    async def small():
        await _until(pool.compiling)  # the slow one holds the slot and compiles
        out["slow pid"] = pid = compile_processes()[1][0]  # (the one worker)
        await _until(lambda: _niceness(pid) >= NICE)  # a long compile: deprioritized
        with pytest.raises(SlotTimeout):  # the one slot is taken: a short wait ends first
            await pool.compile("regex", "[a-z]", 300.0, 0.2)
        g, _ = await pool.compile("regex", "[a-z]+", 300.0, 300.0)
        out["small"] = g

    async def watch():
        while "small" not in out:
            seen.append(compile_processes()[1])
            await anyio.sleep(0.01)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            tg.start_soon(slow)
            tg.start_soon(small)

    try:
        anyio.run(main)
        assert out["slow"] == "timeout" and out["small"] is not None
        assert _gone(out["slow pid"])  # killed and reaped
        assert max(map(len, seen)) == 1, "two compile processes at once"
        servers, workers = compile_processes()  # the same server, a new worker
        assert pool.started == 1 and servers == [pool.server_pid] and len(workers) == 1
        assert workers != [out["slow pid"]]
    finally:
        pool.close()
    assert compile_processes() == ([], [])


def test_a_cancelled_compile_is_stopped_and_the_server_serves_on(vocab):
    pool = _pool(vocab, 1)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.compile, SLOW.kind, SLOW.text, 300.0, 300.0)
            await _until(pool.compiling)
            pid = compile_processes()[1][0]  # (the one worker)
            tg.cancel_scope.cancel()  # as the engine's stop cancels its tasks
        assert _gone(pid) and pool.compiling() == 0  # stopped before the cancel returned
        with anyio.fail_after(120):
            return await pool.compile("regex", "[a-z]+", 300.0, 300.0)

    try:
        g, _ = anyio.run(main)
        assert g is not None and pool.started == 1
    finally:
        pool.close()


def _failing_slow(pool, out: dict, error: type, match: str):
    """A task compiling the slow schema that must fail with ``error`` (``out["victim"]`` set)."""
    async def victim():
        with pytest.raises(error, match=match):
            await pool.compile(SLOW.kind, SLOW.text, 300.0, 300.0)
        out["victim"] = "failed"
    return victim


def test_a_compile_process_that_dies_fails_its_own_request_only(vocab):
    pool = _pool(vocab, 2)
    out: dict = {}

    victim = _failing_slow(pool, out, BadRequestError, r"compiling the json_schema constraint "
                           r"ended its process \(killed by SIGKILL\)")

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            await _until(pool.compiling)
            pid = compile_processes()[1][0]  # (the one worker yet: the victim's)
            out["other"] = await pool.compile("regex", "[0-9]+", 300.0, 300.0)  # beside it
            os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        out["next"] = await pool.compile("json_object", "", 300.0, 300.0)

    try:
        anyio.run(main)
        assert out["victim"] == "failed" and out["other"][0] is not None
        assert out["next"][0] is not None and pool.started == 1
    finally:
        pool.close()
    assert compile_processes() == ([], [])


def test_a_server_that_dies_fails_its_compiles_and_the_next_starts_a_new_one(vocab):
    pool = _pool(vocab, 2)
    out: dict = {}

    victim = _failing_slow(pool, out, EngineError, "the grammar compile server ended")

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            await _until(pool.compiling)
            out["first"] = pool.server_pid
            os.kill(pool.server_pid, signal.SIGKILL)
        out["next"] = await pool.compile("regex", "[0-9]+", 300.0, 300.0)

    try:
        anyio.run(main)
        assert out["victim"] == "failed" and out["next"][0] is not None
        assert pool.started == 2 and pool.server_pid != out["first"]
        assert compile_processes()[0] == [pool.server_pid]  # the first's compile died with it
    finally:
        pool.close()
    assert compile_processes() == ([], [])


_ORPHAN = textwrap.dedent("""
    import os, sys, anyio
    from pathlib import Path
    from engine.structured.compile_pool import CompilePool
    from engine.structured.grammars import tokenizer_info
    from engine.loader.checkpoint import resolve_source

    cfg, _, tok = resolve_source("default")
    pool = CompilePool(lambda: tokenizer_info(tok, cfg.vocab_size), 1)
    kind, text = sys.argv[1], sys.argv[2]

    def children(pid):
        out = []
        for d in Path("/proc").iterdir():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if d.name.isdigit() and int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(d.name))
        return out

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.compile, kind, text, 600.0, 600.0)
            while not pool.compiling() or not children(pool.server_pid):
                await anyio.sleep(0.01)
            await anyio.sleep(1.0)  # its worker is inside xgrammar's compile
            print(pool.server_pid, *children(pool.server_pid), flush=True)
            os.kill(os.getpid(), 9)  # the engine dies without closing anything

    anyio.run(main)
""")


def test_the_server_and_its_compiles_end_with_the_engine_even_mid_compile(vocab):
    with subprocess.Popen([sys.executable, "-c", _ORPHAN, SLOW.kind, SLOW.text],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        try:
            line = proc.stdout.readline()
            assert proc.wait(120) == -signal.SIGKILL
        finally:
            proc.kill()
    pids = [int(p) for p in line.split()]
    assert len(pids) == 2  # the server, its compile
    end = time.monotonic() + 30
    while not all(map(_gone, pids)) and time.monotonic() < end:  # (init reaps them)
        time.sleep(0.05)
    assert all(map(_gone, pids)), "a compile process outlived the engine"


def test_frames_over_their_bound_or_not_messages_are_refused():
    r, w = os.pipe()
    try:
        reader = wire.FrameReader(r, wire.FromWorker, limit=1024)
        os.write(w, (2**31).to_bytes(4, "big"))  # a 2 GiB frame: refused before its body
        with pytest.raises(wire.PeerGone, match="over the bound of 1024"):
            reader.read(time.monotonic() + 5)
        body = b"\x93\x01\x02\x03"  # msgpack, not a message
        os.write(w, len(body).to_bytes(4, "big") + body)
        with pytest.raises(wire.PeerGone, match="not a message"):
            reader.read(time.monotonic() + 5)
        wire.write_frame(w, wire.Failed(7, "no"))
        assert reader.read(time.monotonic() + 5) == wire.Failed(7, "no")
        with pytest.raises(TimeoutError):
            reader.read(time.monotonic() + 0.1)  # nothing comes
        os.close(w)
        w = -1
        with pytest.raises(wire.PeerGone, match="end of pipe"):
            reader.read(time.monotonic() + 5)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    buf = wire.FrameBuffer(limit=64)
    one = wire.frame(wire.Cancel(3))
    assert buf.feed(one[:2]) == [] and buf.feed(one[2:] + one) == [one[4:]] * 2 and len(buf) == 0
    with pytest.raises(wire.PeerGone, match="over the bound of 64"):
        buf.feed((65).to_bytes(4, "big"))


def test_a_server_fed_a_frame_over_its_bound_exits():
    with subprocess.Popen([sys.executable, "-m", "engine.structured.compile_worker"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        try:
            proc.stdin.write((wire.MAX_TO_WORKER + 1).to_bytes(4, "big"))
            proc.stdin.flush()
            assert proc.wait(120) == 2 and proc.stdout.read() == b""  # no answer, gone
        finally:
            proc.kill()
