"""Encode+decode cost of one engine step's ``Outputs`` frame: msgspec frames vs pickle.

    python -m bench.codec [--sizes 1 32 256] [--out bench/results/codec.json]

Each batch holds N ``RequestOutput`` pieces as a decode step produces them (one new token and a
few characters of text each). The msgspec side is exactly what the IPC layer does per frame:
``FrameCodec.encode`` (reused encoder and buffer, length header included) and
``FrameCodec.decode`` with the typed union decoder. Pickle is here only as the comparison (and
the reason not to use it: it runs arbitrary code on load); the engine never imports it.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import random
import struct
import sys
import time
from pathlib import Path

import msgspec

from engine.params import RequestOutput
from ipc.framing import FrameCodec
from ipc.messages import EngineMessage, Outputs

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "codec.json"
_WORDS = [" the", " of", " and", " Paris", ",", " is", " a", " capital", ".", " France", "\n", " 42"]


def make_batch(n: int, step: int = 17, seed: int = 0) -> Outputs:
    """N outputs of one decode step: one token and a short text piece each; ~1/16 finished."""
    rng = random.Random(seed)
    outs = []
    for i in range(n):
        finished = rng.random() < 1 / 16
        outs.append(RequestOutput(
            request_id=f"cmpl-{rng.getrandbits(64):016x}-{i}",
            token_ids=[rng.randrange(49_152)],
            text=rng.choice(_WORDS),
            num_prompt_tokens=rng.randint(16, 1024),
            num_output_tokens=step,
            finished=finished,
            finish_reason="length" if finished else None,
        ))
    return Outputs(outputs=outs)


def _time(fn, min_time: float, repeat: int) -> float:
    """Best mean seconds per call over ``repeat`` runs of at least ``min_time`` each."""
    fn()  # warm up
    n = 1
    while True:  # calibrate
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / 4:
            break
        n *= 2
    n = max(1, int(n * min_time / max(dt, 1e-9)))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def bench_size(n: int, min_time: float, repeat: int) -> dict:
    batch = make_batch(n)
    enc_codec = FrameCodec(EngineMessage)
    dec_codec = FrameCodec(EngineMessage)
    header = struct.Struct(">I")

    frame = enc_codec.encode(batch)
    assert dec_codec.decode(frame[4:]) == batch
    pickled = pickle.dumps(batch.outputs, protocol=pickle.HIGHEST_PROTOCOL)
    assert pickle.loads(pickled) == batch.outputs

    def msgspec_round_trip() -> None:
        f = enc_codec.encode(batch)
        dec_codec.decode(memoryview(f)[4:])

    def msgspec_encode() -> None:
        enc_codec.encode(batch)

    def msgspec_decode() -> None:
        dec_codec.decode(memoryview(frame)[4:])

    def pickle_round_trip() -> None:
        body = pickle.dumps(batch.outputs, protocol=pickle.HIGHEST_PROTOCOL)
        f = header.pack(len(body)) + body
        pickle.loads(memoryview(f)[4:])

    ms = _time(msgspec_round_trip, min_time, repeat)
    pk = _time(pickle_round_trip, min_time, repeat)
    return {
        "batch": n,
        "msgspec_us": ms * 1e6,
        "msgspec_encode_us": _time(msgspec_encode, min_time, repeat) * 1e6,
        "msgspec_decode_us": _time(msgspec_decode, min_time, repeat) * 1e6,
        "pickle_us": pk * 1e6,
        "speedup": pk / ms,
        "msgspec_us_per_output": ms * 1e6 / n,
        "pickle_us_per_output": pk * 1e6 / n,
        "msgspec_bytes": len(frame),
        "pickle_bytes": len(pickled) + 4,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timing run")
    ap.add_argument("--repeat", type=int, default=5, help="timing runs (best is kept)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    rows = [bench_size(n, args.min_time, args.repeat) for n in args.sizes]

    head = (f"{'batch':>6} {'msgspec µs':>11} {'(enc':>8} {'dec)':>8} {'pickle µs':>10} "
            f"{'speedup':>8} {'µs/out ms':>10} {'µs/out pk':>10} {'bytes ms':>9} {'bytes pk':>9}")
    print("Outputs frame encode+decode, one engine step (best of "
          f"{args.repeat} x {args.min_time}s)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['batch']:>6} {r['msgspec_us']:>11.2f} {r['msgspec_encode_us']:>8.2f} "
              f"{r['msgspec_decode_us']:>8.2f} {r['pickle_us']:>10.2f} {r['speedup']:>7.1f}x "
              f"{r['msgspec_us_per_output']:>10.3f} {r['pickle_us_per_output']:>10.3f} "
              f"{r['msgspec_bytes']:>9} {r['pickle_bytes']:>9}")

    result = {
        "benchmark": "codec",
        "description": "encode+decode of one Outputs frame (N RequestOutputs, 1 token each): "
                       "msgspec FrameCodec vs pickle",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "msgspec": msgspec.__version__,
        "pickle_protocol": pickle.HIGHEST_PROTOCOL,
        "min_time_s": args.min_time,
        "repeat": args.repeat,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
