"""The Hugging Face transformers peers of ``bench.throughput`` (cuda default, also run on cpu):
``hf-generate`` (``generate`` on left-padded static batches) and ``hf-cb`` (transformers'
continuous batching manager), on exactly the engine's synthetic weights."""

from __future__ import annotations

import gc
from typing import Any

import torch

from . import common
from .common import now
from .recorder import Recorder, warm_work


def build_hf_model(args):
    """The peer: a transformers model built from the preset's config, holding exactly the
    engine's synthetic weights (same seed, same fill), on the benchmark device and dtype."""
    import transformers

    from engine.loader.checkpoint import build_model, resolve_source

    device, dtype = torch.device(args.device), common.torch_dtype(args.dtype)
    cfg, tensors, _ = resolve_source(args.model)
    ours = build_model(cfg, tensors, device, dtype, args.seed, args.model)
    d = dict(cfg.to_hf_dict())
    model_type = d.pop("model_type")
    d.pop("torch_dtype", None)
    hf_cfg = transformers.AutoConfig.for_model(model_type, **d)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        try:
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        except TypeError:
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=dtype)
    hf = hf.to(device=device, dtype=dtype).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    del ours
    gc.collect()
    return hf


def run_hf_generate(args, work, hf) -> dict[str, Any]:
    device = torch.device(args.device)
    T = args.temperature
    B = args.hf_batch
    with torch.inference_mode():
        # warm-up: one small batch
        p0 = work[0][0]
        hf.generate(torch.tensor([p0], device=device), attention_mask=torch.ones(1, len(p0), dtype=torch.long, device=device),
                    max_new_tokens=4, min_new_tokens=4, do_sample=T > 0, temperature=T if T > 0 else None,
                    top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
        common.sync(device)
        generated = 0
        with common.progress(sum(o for _, o in work), "hf-generate", "tok", args.no_progress) as bar:
            rec = Recorder(work, bar)
            rec.t0 = now()
            for b0 in range(0, len(work), B):
                chunk = work[b0:b0 + B]
                width = max(len(p) for p, _ in chunk)
                new = max(o for _, o in chunk)
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, (p, _) in enumerate(chunk):
                    ids[r, width - len(p):] = torch.tensor(p)
                    mask[r, width - len(p):] = 1
                for r in range(len(chunk)):
                    rec.submitted(b0 + r, rec.t0)
                hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                            min_new_tokens=new, do_sample=T > 0, temperature=T if T > 0 else None,
                            top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
                common.sync(device)
                generated += new * len(chunk)
                for r, (_, o) in enumerate(chunk):
                    rec.out_tokens[b0 + r] = o
                    rec.finish[b0 + r] = "length"
                bar.update(sum(o for _, o in chunk))
            rec.t1 = now()
    res = rec.summary("hf-generate", batch=B, generated_tokens_incl_padding_waste=generated,
                      note="static batches; requested tokens counted; no streaming (no TTFT/ITL)")
    return res


def _hf_finished(r) -> bool:
    fn = getattr(r, "is_finished", None)
    if fn is not None:
        return bool(fn())
    return str(getattr(r, "status", "")).upper().endswith(("FINISHED", "FAILED"))


def _hf_next(manager, limit: float):
    """The next result of transformers' manager; fails at once if its generation thread died."""
    t_end = now() + limit
    while now() < t_end:
        r = manager.get_result(timeout=0.5)
        if r is not None:
            return r
        alive = getattr(manager, "is_running", None)
        if alive is not None and not alive():
            raise RuntimeError("hf continuous batching: its generation thread stopped (see its log above)")
    raise RuntimeError(f"hf continuous batching: no result within {limit:.0f} s")


def _cb_sizing(args, work) -> dict[str, Any]:
    """Off the GPU, size transformers' paged cache to the workload.

    Left to itself it sizes the cache from free *host* memory on cpu (6.7 GB of RSS on a 24 GiB
    CI machine, and minutes of page faults before the first token); on cuda its own sizing is
    what a user gets, so it is kept.
    """
    if args.device == "cuda":
        return {}
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # older transformers: no such knob, nothing to size
        return {}
    page = ContinuousBatchingConfig.page_size
    blocks = sum(-(-(len(p) + o) // page) for p, o in work) + 2
    longest = max(len(p) + o for p, o in work)
    return {"continuous_batching_config": ContinuousBatchingConfig(
        num_blocks=blocks, max_batch_tokens=max(256, min(2048, longest)))}


def run_hf_cb(args, work, hf) -> dict[str, Any]:
    import transformers

    if not hasattr(hf, "init_continuous_batching"):
        return {"mode": "hf-cb", "skipped": f"transformers {transformers.__version__} has no continuous batching"}
    T = args.temperature
    gen_cfg = transformers.GenerationConfig(
        max_new_tokens=max(o for _, o in work), do_sample=T > 0, temperature=T if T > 0 else 1.0,
        top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=0)
    rec = None
    manager = hf.init_continuous_batching(generation_config=gen_cfg, **_cb_sizing(args, work))
    # No inference_mode here: transformers 5.17 runs its generation thread outside it, and static
    # tensors made under it in this thread then fail their in-place reset there.
    if hasattr(manager, "warmup") and args.device == "cuda":
        manager.warmup()
    manager.start()
    try:
        def add(rid, ids, n):
            try:
                return manager.add_request(input_ids=ids, request_id=rid, max_new_tokens=n,
                                           record_timestamps=True)
            except TypeError:
                return manager.add_request(input_ids=ids, request_id=rid, max_new_tokens=n)

        # warm-up
        if args.warmup:
            for i, (p, o) in enumerate(warm_work(work, args.warmup)):
                add(f"w{i}", p, o)
            got = 0
            while got < min(args.warmup, len(work)):
                r = _hf_next(manager, 60)
                got += _hf_finished(r)
        with common.progress(sum(o for _, o in work), "hf-cb", "tok", args.no_progress) as bar:
            rec = Recorder(work, bar)
            rec.t0 = now()
            for i, (p, o) in enumerate(work):
                rec.submitted(i, now())
                add(f"r{i}", p, o)
            left = len(work)
            while left:
                r = _hf_next(manager, 120)
                if not _hf_finished(r) or not r.request_id.startswith("r"):
                    continue
                i = int(r.request_id[1:])
                left -= 1
                toks = len(r.generated_tokens)
                ts = getattr(r, "timestamps", None)
                if ts:
                    for k, t in enumerate(ts):
                        rec.piece(i, t, 1)
                    rec.out_tokens[i] = toks
                else:
                    rec.piece(i, now(), toks)
                err = getattr(r, "error", None)
                rec.finish[i] = "length" if err is None else f"error: {err}"
                rec.flush_bar()
            rec.t1 = now()
    finally:
        try:
            manager.stop(block=True, timeout=30)
        except TypeError:
            manager.stop(block=True)
        destroy = getattr(hf, "destroy_cached_continuous_batching_manager", None)
        if destroy:
            destroy()
    return rec.summary("hf-cb", attn=getattr(hf.config, "_attn_implementation", None),
                       note="TTFT/ITL from transformers' per-token timestamps (record_timestamps)")
