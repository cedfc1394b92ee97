"""End to end: a real ``enginecore serve`` process (random:tiny-llama, with a token), clients in
other processes, the sync client and ``enginecore generate --connect``."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from engine.params import SamplingParams
from ipc.client import EngineClient
from ipc.errors import AuthError, ConnectionClosed
from ipc.framing import FrameCodec, FrameReader
from ipc.messages import PROTOCOL_VERSION, EngineMessage, Error, ErrorKind, Hello
from ipc.spawn import EngineProcess
from ipc.sync_client import SyncEngineClient
from ipc.transport import connect

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:tiny-llama"
TOKEN = "e2e-s3cret"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

# A client process: streams its requests concurrently, prints {rid: [tokens, text, finish]}.
CLIENT = """
import json, sys, anyio
from engine.params import SamplingParams
from ipc.client import EngineClient

async def main():
    addr, token, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    results = {}
    async with EngineClient.connect(addr, token=token, client_name="e2e") as c:
        async def one(rid, prompt, n):
            toks, text, last = [], [], None
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            async for out in c.generate(prompt, params, request_id=rid):
                toks += out.token_ids
                text.append(out.text)
                last = out
            results[rid] = [toks, "".join(text), last.finish_reason]
        async with anyio.create_task_group() as tg:
            for rid, prompt, n in spec:
                tg.start_soon(one, rid, prompt, n)
    print(json.dumps({"results": results, "torch": "torch" in sys.modules}))

anyio.run(main)
"""

# A client process that starts long streams, says so, and reads until it is killed.
LONG_CLIENT = """
import sys, anyio
from engine.params import SamplingParams
from ipc.client import EngineClient

async def main():
    async with EngineClient.connect(sys.argv[1], token=sys.argv[2]) as c:
        streams = [c.generate([i + 1, 7, 9], SamplingParams(max_tokens=1500, ignore_eos=True))
                   for i in range(8)]
        for s in streams:
            await s.__anext__()
        print("STARTED", flush=True)
        async def drain(s):
            async for _ in s:
                pass
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(drain, s)

anyio.run(main)
"""


@pytest.fixture(scope="module")
def engine():
    """One ``enginecore serve`` process for the module, with a token."""
    proc = EngineProcess.start(None, token=TOKEN, drain_timeout=1.0, args=["--model", MODEL])
    try:
        proc.wait_ready(180)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.stop(30)
    assert code == 0, proc.stderr_tail()


def requests_for(k: int) -> list:
    """32 greedy requests for client ``k``: token and text prompts, various lengths."""
    out = []
    for i in range(32):
        if i % 4 == 3:
            prompt = f"client {k} says {i} times hello"
        else:
            prompt = [(7 * k + 3 * i + j * 11) % 250 + 1 for j in range(2 + (i * 5 + k) % 9)]
        out.append([f"k{k}-{i}", prompt, 6 + (i + k) % 11])
    return out


async def wait_health(c: EngineClient, cond, timeout: float) -> tuple:
    """Poll health until ``cond(h)``; (health, seconds waited)."""
    t0 = time.monotonic()
    with anyio.fail_after(timeout):
        while True:
            h = await c.health()
            if cond(h):
                return h, time.monotonic() - t0
            await anyio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_three_client_processes_match_the_in_process_engine(engine):
    specs = {k: requests_for(k) for k in range(3)}
    outputs: dict = {}

    async def run_client(k: int) -> None:
        proc = await anyio.run_process(
            [sys.executable, "-c", CLIENT, engine.bound_address, TOKEN, json.dumps(specs[k])],
            env=ENV, check=False)
        assert proc.returncode == 0, proc.stderr.decode()
        outputs[k] = json.loads(proc.stdout)

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for k in specs:
                tg.start_soon(run_client, k)
    assert not any(o["torch"] for o in outputs.values())  # `import ipc` stays torch-free
    got = {rid: r for o in outputs.values() for rid, r in o["results"].items()}
    assert len(got) == 96

    from engine import AsyncEngine, EngineConfig

    expected = {}
    async with AsyncEngine.open(EngineConfig(model=MODEL)) as eng:
        async def one(rid, prompt, n):
            toks, text, last = [], [], None
            async for out in eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
                toks += out.token_ids
                text.append(out.text)
                last = out
            expected[rid] = [toks, "".join(text), last.finish_reason]

        async with anyio.create_task_group() as tg:
            for spec in specs.values():
                for rid, prompt, n in spec:
                    tg.start_soon(one, rid, prompt, n)
    assert got == expected
    assert all(r[2] == "length" and len(r[0]) == n
               for spec in specs.values() for rid, _, n in spec for r in [got[rid]])


@pytest.mark.slow
@pytest.mark.asyncio
async def test_killed_client_frees_its_requests(engine):
    async with EngineClient.connect(engine.bound_address, token=TOKEN) as c:
        reference = await c.complete([5, 6, 7], SamplingParams(max_tokens=24, ignore_eos=True))
        victim = await anyio.open_process([sys.executable, "-c", LONG_CLIENT,
                                           engine.bound_address, TOKEN], env=ENV)
        try:
            async with victim:
                with anyio.fail_after(60):
                    line = await victim.stdout.receive()
                assert line.startswith(b"STARTED"), line
                h = await c.health()
                assert h.running + h.waiting == 8 and h.kv_usage > 0
                # Another client's stream is in flight when the victim dies.
                s = c.generate([5, 6, 7], SamplingParams(max_tokens=24, ignore_eos=True))
                first = await s.__anext__()
                t_kill = time.monotonic()
                victim.kill()  # SIGKILL
                h, freed_after = await wait_health(c, lambda h: h.running + h.waiting <= 1, 5)
                rest = [out async for out in s]
                assert [t for o in [first, *rest] for t in o.token_ids] == reference.token_ids
                assert rest[-1].finish_reason == "length"
                await wait_health(
                    c, lambda h: h.running == 0 and h.waiting == 0 and h.kv_usage == 0.0, 5)
                idle_after = time.monotonic() - t_kill
        finally:
            if victim.returncode is None:
                victim.kill()
    assert victim.returncode == -signal.SIGKILL
    print(f"\nvictim's 8 requests gone {freed_after * 1000:.0f} ms after its SIGKILL; engine idle "
          f"(kv_usage 0.0) {idle_after * 1000:.0f} ms after it, the other stream done")
    assert freed_after < 2.0 and idle_after < 4.0


def _raw_handshake(address: str, first: bytes) -> list:
    """Send ``first`` on a fresh connection; every frame the engine sends until it closes."""

    async def go() -> list:
        stream = await connect(address)
        reader = FrameReader(stream, FrameCodec(EngineMessage))
        msgs = []
        async with stream:
            await stream.send(first)
            with anyio.fail_after(10):
                while True:
                    try:
                        msgs.append(await reader.read())
                    except ConnectionClosed:
                        return msgs

    return anyio.run(go)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_bad_handshakes_are_refused_and_others_are_unaffected(engine):
    codec = FrameCodec()
    cases = [
        (codec.encode(Hello(protocol_version=PROTOCOL_VERSION + 1, token=TOKEN)), ErrorKind.VERSION),
        (codec.encode(Hello(protocol_version=PROTOCOL_VERSION, token="wrong")), ErrorKind.AUTH),
        (codec.encode(Hello(protocol_version=PROTOCOL_VERSION)), ErrorKind.AUTH),
        (struct.pack(">I", 6) + b"\xc1garbg", ErrorKind.PROTOCOL),
        (struct.pack(">I", 64 * 1024 + 1), ErrorKind.TOO_LARGE),  # no body follows
        (struct.pack(">I", 2**32 - 1) + b"x" * 100, ErrorKind.TOO_LARGE),
    ]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    async with EngineClient.connect(engine.bound_address, token=TOKEN) as good:
        streams = [good.generate([9, i + 1], params) for i in range(4)]
        firsts = [await s.__anext__() for s in streams]
        for first, kind in cases:
            msgs = await anyio.to_thread.run_sync(_raw_handshake, engine.bound_address, first)
            assert len(msgs) == 1 and isinstance(msgs[0], Error), msgs
            assert msgs[0].kind is kind and msgs[0].fatal and msgs[0].message
        with pytest.raises(AuthError, match="token"):
            async with EngineClient.connect(engine.bound_address, token="wrong"):
                pass
        outs = [[first, *[o async for o in s]] for first, s in zip(firsts, streams)]
        assert all(o[-1].finish_reason == "length" and o[-1].num_output_tokens == 20 for o in outs)
        for i, o in enumerate(outs):
            again = await good.complete([9, i + 1], params)
            assert [t for p in o for t in p.token_ids] == again.token_ids
        assert (await good.health()).ready


@pytest.mark.slow
def test_sync_client_and_cli_generate(engine):
    with SyncEngineClient.connect(engine.bound_address, token=TOKEN) as c:
        assert c.model == MODEL and c.state.value == "serving"
        params = SamplingParams(max_tokens=8)
        pieces = list(c.generate("hello", params))
        assert pieces[-1].finished and all(not p.finished for p in pieces[:-1])
        total = c.complete("hello", params)
        assert total.text == "".join(p.text for p in pieces)
        assert total.token_ids == [t for p in pieces for t in p.token_ids]
        assert total.finish_reason == pieces[-1].finish_reason and total.num_output_tokens == len(total.token_ids)
        with c.generate([1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True)) as s:
            next(s)  # leaving the with-block aborts it
        deadline = time.monotonic() + 5
        while (h := c.health()).running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h.running == 0 and h.ready
    cli = subprocess.run([sys.executable, "-m", "entrypoints.cli", "generate", "--connect",
                          engine.bound_address, "--token", TOKEN, "--max-tokens", "8", "hello"],
                         env=ENV, capture_output=True, timeout=120)
    assert cli.returncode == 0, cli.stderr.decode()
    assert cli.stdout.decode() == "hello" + total.text + "\n"
    bad = subprocess.run([sys.executable, "-m", "entrypoints.cli", "generate", "--connect",
                          engine.bound_address, "--token", "wrong", "hi"],
                         env=ENV, capture_output=True, timeout=120)
    assert bad.returncode == 2 and b"token" in bad.stderr


@pytest.mark.slow
def test_sync_spawn_round_trip_and_clean_exit():
    from engine import EngineConfig

    with SyncEngineClient.spawn(EngineConfig(model=MODEL), startup_timeout=180) as c:
        proc = c.client.process
        sock = proc.bound_address[len("unix://"):]
        assert c.exit_code is None and os.stat(os.path.dirname(sock)).st_mode & 0o777 == 0o700
        out = c.complete([3, 1, 4, 1, 5], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        chat = c.apply_chat_template([{"role": "user", "content": "hi"}])
        assert chat == "user: hi\nassistant: "  # random presets have no template: the fallback
    assert c.exit_code == 0  # Shutdown on exit, then reaped
    assert not os.path.exists(os.path.dirname(sock))  # the private directory is gone
