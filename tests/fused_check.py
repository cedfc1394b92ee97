"""The fused decoder path (engine/ops/triton/fused_ops.py) against the plain torch path on one model.

``compare(model, device, dtype)`` runs the same packed steps -- two prefills, then two chunks
after context (one over 64 queries long), then a decode batch -- through both paths from an empty KV cache
and returns the largest absolute differences of the logits and of the KV cache, and the
fraction of rows whose argmax agrees. Used by tests/test_fused_ops.py (CPU, Triton's
interpreter, fp32) and tests/gpu/test_gpu_fused.py (bf16 on CUDA).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.config import EngineConfig
from engine.forward.step_inputs import packed_forward
from engine.memory.owner import Resource as R
from engine.model import fused_linears
from engine.runner.model_runner import ModelRunner


def _runner(model: str, device: str, dtype: str, graphs: bool = False,
            blocks: Optional[int] = None) -> ModelRunner:
    """``blocks``: KV blocks (None: what 64 MiB hold, 18 of qwen3-0.6b in fp32)."""
    r = ModelRunner(EngineConfig(model=model, device=device, dtype=dtype, kv_cache_bytes=2**26,
                                 num_kv_blocks=blocks, max_num_seqs=8, cuda_graphs=graphs,
                                 enable_prefix_caching=False))
    r.load()
    return r


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    # counted, not a float mean: a mean of ones on CUDA can come back as 0.99999994
    return int((a.argmax(-1) == b.argmax(-1)).sum().item()) / a.shape[0]


def compare(model: str, device: str, dtype: str, reference: bool = False) -> dict:
    """With ``reference``, both paths are also measured against the plain path in float32 on
    the same (``dtype``-rounded) weights: ``plain_vs_fp32`` / ``fused_vs_fp32`` say whether the
    fused path's rounding is of the plain path's size."""
    r = _runner(model, device, dtype)
    try:
        lm, kv, st = r.resource(R.WEIGHTS), r.resource(R.KV_CACHE), r.resource(R.MODEL_STATE)
        b = list(range(4, 15))  # 11 blocks: 176 tokens at block size 16
        steps = [
            [(list(range(5, 42)), 0, [1, 2, 3], False), (list(range(9, 109)), 0, b, False)],
            # chunks after context (a cached prefix, a long prompt's next chunk): > 64 queries
            [(list(range(50, 60)), 37, [1, 2, 3], False), (list(range(200, 270)), 100, b, False)],
            [([7], 47, [1, 2, 3], True), ([8], 170, b, True)],  # decodes
        ]

        def run(fused: bool, runner: ModelRunner = r):
            m, cache = runner.resource(R.WEIGHTS), runner.resource(R.KV_CACHE).tensor
            m.use_fused = fused
            cache.zero_()
            outs = []
            with torch.inference_mode():
                for seqs in steps:
                    h = packed_forward(m, cache, runner.resource(R.MODEL_STATE), None,
                                       runner.device, runner.block_size, seqs)
                    outs.append(m.logits(h).float())
            m.use_fused = None
            return torch.cat(outs), cache.float().clone()

        (la, ka), (lb, kb) = run(False), run(True)
        res = {"logits_max_abs": (la - lb).abs().max().item(),
               "logits_scale": la.abs().max().item(),
               "kv_max_abs": (ka - kb).abs().max().item(),
               "argmax_agree": _agree(la, lb),
               "rows": la.shape[0],
               # checkpoint tensors living in fused q/k/v, gate/up weights (fused_linears)
               "fused_views": len(fused_linears.views(lm))}
        if reference:
            ref = _runner(model, device, "float32")
            try:
                with torch.no_grad():
                    for pr, pb in zip(ref.resource(R.WEIGHTS).parameters(), lm.parameters()):
                        pr.copy_(pb.float())
                lr, _ = run(False, ref)
            finally:
                ref.shutdown()
            res["plain_vs_fp32"] = (la - lr).abs().max().item()
            res["fused_vs_fp32"] = (lb - lr).abs().max().item()
        return res
    finally:
        r.shutdown()


def compare_decode(device: str = "cpu") -> float:
    """The Triton paged decode kernel against the torch decode path on random caches (GQA 4
    and 1, contexts from 1 token to more than one split); the largest absolute difference."""
    from engine.model.attention import AttentionMetadata, decode_attention_torch
    from engine.ops.triton import decode_attention as ta

    if device == "cpu":  # Triton's interpreter: no device properties to size the grid from
        ta._sm_count = lambda dev: 4
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for heads, kv_heads, dim, lens in [(8, 2, 64, [17, 100, 1100]), (4, 4, 32, [1, 33])]:
        bs, nb = 16, 240  # 1,100 tokens: more than one split (SPLIT_TOKENS)
        cache = torch.randn(2, nb, bs, kv_heads, dim, generator=g).to(device)
        width = max(-(-n // bs) for n in lens)
        bt = (torch.randperm(nb - 1, generator=g)[: len(lens) * width] + 1).view(len(lens), width)
        q = torch.randn(len(lens), heads, dim, generator=g).to(device)
        rows, cl, bt = (torch.arange(len(lens)).to(device), torch.tensor(lens).to(device),
                        bt.to(device))
        out, ref = torch.zeros_like(q), torch.zeros_like(q)
        ta.decode_attention(q, cache, rows, bt, cl, dim ** -0.5, out)
        meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), [], rows, bt, cl,
                                 max(lens))
        decode_attention_torch(q, cache, meta, dim ** -0.5, ref)
        worst = max(worst, (out - ref).abs().max().item())
    return worst


def compare_prefill(device: str = "cpu", names: Optional[Sequence[str]] = None) -> dict:
    """The paged prefill kernel (engine/ops/triton/prefill_attention.py), plain and with query heads packed
    per program, stacked or interleaved (``KernelChoice``), against a dense torch reference
    over random caches: GQA 4, 2 and 1; chunks of one query, of several tiles, after a context
    of many blocks, ending mid-block; keys whose scores keep growing from tile to tile. The
    largest absolute difference per choice."""
    from engine.ops.triton import prefill_attention as tp

    g = torch.Generator().manual_seed(0)
    choices = {"default": tp.KernelChoice(), "plain": tp.KernelChoice(packed=1, interleave=0),
               "packed2": tp.KernelChoice(packed=2, interleave=0),
               "packed4_n32": tp.KernelChoice(packed=4, block_n=32, warps=8, interleave=0),
               "interleaved4": tp.KernelChoice(packed=4)}
    if names is not None:  # (on the device each fp32 variant compiles for ~10 s)
        choices = {k: choices[k] for k in names}
    worst = dict.fromkeys(choices, 0.0)
    # the last case scales each block's keys by 1-12x: scores whose running maximum moves a lot
    for heads, kv_heads, dim, ramp in [(8, 2, 32, False), (4, 2, 64, False), (4, 4, 16, False),
                                       (4, 2, 32, True)]:
        bs, nb = 16, 200
        cache = torch.randn(2, nb, bs, kv_heads, dim, generator=g)
        if ramp:
            cache[0] *= torch.linspace(1.0, 12.0, nb)[:, None, None, None]
        # (queries, context incl. the queries): fresh, after a long context, one query,
        # several tiles ending mid-block
        # (on CPU the long context is 500 keys, 7 unmasked tiles: 1,100 took the interpreter
        # ~40 % longer, and no code path of the kernel changes past 2 tiles)
        shapes = [(37, 37), (70, 1100 if device != "cpu" else 500), (1, 300), (130, 161)]
        chunks, row, used = [], 0, 1
        for n, ctx in shapes:
            nblk = -(-ctx // bs)
            blocks = list(range(used, used + nblk))
            used += nblk
            chunks.append((row, n, ctx, blocks))
            row += n
        perm = torch.randperm(nb - 1, generator=g) + 1  # blocks scattered through the cache
        chunks = [(qs, n, ctx, [int(perm[b - 1]) for b in blocks]) for qs, n, ctx, blocks in chunks]
        q = torch.randn(row, heads, dim, generator=g)
        ref = torch.zeros_like(q)
        gqa = heads // kv_heads
        for qs, n, ctx, blocks in chunks:
            tok = torch.arange(ctx)
            phys = torch.tensor(blocks)[tok // bs]
            k = cache[0][phys, tok % bs]  # [ctx, Hkv, D]
            v = cache[1][phys, tok % bs]
            qq = q[qs:qs + n]  # [n, H, D]
            kk = k.repeat_interleave(gqa, dim=1)
            vv = v.repeat_interleave(gqa, dim=1)
            sc = torch.einsum("nhd,thd->hnt", qq, kk) * dim ** -0.5
            pos = torch.arange(ctx - n, ctx)
            sc = sc.masked_fill(tok[None, None, :] > pos[None, :, None], float("-inf"))
            ref[qs:qs + n] = torch.einsum("hnt,thd->nhd", sc.softmax(-1), vv)
        batch = tp.build(chunks, bs, torch.device(device))
        kernel = tp._prefill_kernel
        if device == "cpu":  # (restored below)
            tp._prefill_kernel = _LaunchOnce(kernel)
        try:
            for name, choice in choices.items():
                out = torch.zeros_like(q).to(device)
                tp.prefill_attention(q.to(device), cache.to(device), batch, dim ** -0.5, out,
                                     choice)
                worst[name] = max(worst[name], (out.cpu() - ref).abs().max().item())
        finally:
            tp._prefill_kernel = kernel
    return worst


class _LaunchOnce:
    """A kernel launched as before, but a launch whose grid and arguments other than the
    tensors are those of an earlier one (the same inputs: one case of ``compare_prefill``)
    takes that one's output instead of running again: choices that come to the same launch
    for a case's GQA (on GQA 1 every packing is one program a head) cost the interpreter once."""

    def __init__(self, kernel):
        self.kernel, self.done = kernel, {}

    def __getitem__(self, grid):
        def launch(*args, **kw):
            out = args[3]  # (q, k, v, out, ...)
            key = (tuple(grid), tuple(a for a in args if not isinstance(a, torch.Tensor)),
                   tuple(sorted(kw.items())))
            if key in self.done:
                out.copy_(self.done[key])
                return
            self.kernel[grid](*args, **kw)
            self.done[key] = out.clone()
        return launch


class _EagerMixed:
    """What ``packed_forward`` asks of ``CudaGraphs`` for a step with prompt chunks, with the
    fixed-shape inputs of engine/forward/mixed_inputs.py, run eagerly (no graph: CPU, the interpreter)."""

    def __init__(self, mixed, scratch_block: int, block_size: int):
        self.mixed = mixed
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.rows: list[int] = []

    def bucket(self, n: int):
        return None

    def mixed_rows(self, t: int, n_chunks: int, n_decode: int):
        return self.mixed.fits(t, n_chunks, n_decode)

    def run_mixed(self, rows: int, model, kv, state, meta):
        self.rows.append(rows)
        buf = state.buffers
        return model(buf["input_ids"][:rows], buf["positions"][:rows], kv, meta)


def _more_mixed_steps(nb: int) -> list:
    """The rarer shapes of mixed steps, over non-consecutive block ids below ``nb`` (the
    scratch block): as many chunks as the cap and no decode row, chunks after a context longer
    than a decode split (a prefix-cache hit over many blocks), chunks of 64 and 65 queries, a
    decode row over more than one split, draft-like decode rows (several of one sequence),
    in-flight tokens (``fill``), every decode row real, then one chunk after the many (the
    tiles and tables of the step before stale). ``(seqs, fill)`` a step."""
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).tolist()
    tables, at = [], 0
    for n in (80, 6, 6, 6, 2, 2, 2, 2, 6):  # blocks: A (1,280 tokens), B..H, I
        tables.append(perm[at:at + n])
        at += n
    A, B, C, D, E, F, G, H, I = tables
    toks = lambda lo, n: [(lo + i) % 500 for i in range(n)]  # noqa: E731
    return [
        # 8 chunks (the cap at max_num_seqs 8), no decode row: 213 tokens, 256 rows
        ([(toks(10, 70), 1040, A, False), (toks(20, 65), 0, B, False),
          (toks(30, 64), 0, C, False), (toks(40, 1), 5, D, False), (toks(50, 3), 0, E, False),
          (toks(60, 2), 0, F, False), (toks(70, 7), 20, G, False), (toks(80, 1), 0, H, False)],
         None),
        # a decode row over two splits (1,111 keys), draft-like rows, in-flight tokens: 64 rows
        ([([0], 1110, A, True), ([5], 65, B, True), ([6, 7, 0], 64, C, True),
          (toks(90, 40), 6, D, False)], [(0, 0), (4, 1)]),
        # one chunk and 8 decode rows (all real): 57 tokens, 64 rows
        ([([8], 1111, A, True), ([9], 66, B, True), ([10], 67, C, True),
          (toks(100, 49), 0, I, False), ([11], 46, D, True), ([12], 3, E, True),
          ([13], 2, F, True), ([0], 27, G, True), ([14], 1, H, True)], [(55, 2)]),
        # one chunk after the 8: 130 queries after 1,112 keys (78 blocks), 192 rows
        ([(toks(110, 130), 1112, A, False)], None),
    ]


def compare_mixed(model: str, device: str = "cpu", dtype: str = "float32",
                  variant: str = "basic") -> dict:
    """Steps with prompt chunks (and decode rows) through the fixed-shape inputs of
    engine/forward/mixed_inputs.py against the same steps' eager inputs: the largest absolute
    differences of the logits (real rows) and of the KV cache (but the scratch block).

    ``variant="more"``: the rarer shapes of :func:`_more_mixed_steps` over a KV cache of random
    values (a wrong block read shows), and on CPU the fixed-shape inputs' decode rows through
    the Triton decode kernel (split-K and its reduce, as on CUDA) against the torch decode path
    of the eager inputs."""
    from engine.forward.mixed_inputs import MixedInputs
    from engine.ops.triton import decode_attention as ta, fused_ops

    if device == "cpu":
        ta._sm_count = lambda dev: 4
    more = variant == "more"
    # NOTE: KV blocks by count: 64 MiB hold 18 of qwen3-0.6b in fp32 (the GPU test), fewer than
    # the steps below use (block 20; 111 in "more"): they wrote past the cache and read the
    # scratch block
    r = _runner(model, device, dtype, graphs=device == "cuda", blocks=128)
    try:
        lm, cache, st = r.resource(R.WEIGHTS), r.resource(R.KV_CACHE).tensor, r.resource(R.MODEL_STATE)
        # no step below uses it: on CUDA the graphs' own scratch block, the last
        scratch = r.num_blocks if device == "cuda" else r.num_blocks - 1
        b = list(range(4, 15))
        steps = [(seqs, None) for seqs in [
            # two fresh prompts and a short one (157 tokens: 192 rows)
            [(list(range(5, 42)), 0, [1, 2, 3], False), (list(range(9, 109)), 0, b, False),
             (list(range(60, 80)), 0, [15, 16], False)],
            # chunks after context, with a decode row (81 tokens: 128 rows)
            [(list(range(50, 60)), 37, [1, 2, 3], False), (list(range(200, 270)), 100, b, False),
             ([7], 20, [15, 16], True)],
            # a chunk and three decode rows, 64 tokens: 64 rows, none of them padding
            [([9], 47, [1, 2, 3], True), ([8], 170, b, True), ([6], 21, [15, 16], True),
             (list(range(300, 361)), 0, [17, 18, 19, 20], False)],
            # a decode row over many blocks beside a one-token chunk (a prompt's last token)
            [([4], 171, b, True), ([11], 60, [17, 18, 19, 20], False)],
        ]]
        if more:
            steps = _more_mixed_steps(scratch)
            init = torch.randn(cache.shape, generator=torch.Generator().manual_seed(2))
        used = max(x for seqs, _ in steps for s in seqs for x in s[2])
        assert used < scratch, f"the steps use block {used}; the cache has {scratch} (and scratch)"
        sampled = torch.tensor([123, 77, 45])  # the in-flight tokens of ``fill``

        def run(graphs):
            if more:
                cache.copy_(init.to(cache))
            else:
                cache.zero_()
            st.buffers["sampled"][:3] = sampled
            outs = []
            supported, sm_count, usable = ta.supported, ta._sm_count, fused_ops.usable
            # NOTE: on CPU (Triton's interpreter) the reference runs the plain torch path
            # throughout: the interpreted kernels were ~half of this check's time, and the
            # fixed-shape run below still takes them (the fused path against the plain one is
            # tests/test_fused_ops.py's first check; a kernel bug shows here too)
            lm.use_fused = False if graphs is None and device == "cpu" else None
            if more and graphs is not None and device == "cpu":  # the decode kernel, interpreted
                ta.supported = lambda q, c: c.stride(-1) == 1 and q.stride(-1) == 1
                # a grid of several programs per sequence (its splits taken in turn), as on CUDA
                ta._sm_count = lambda dev: 64
                # the rare shapes are the attention's (its metadata, the prefill and decode
                # kernels, still interpreted); the decoder's norm/rotary/MLP kernels, ~2/3 of
                # this run in the interpreter, stay on the torch path here ("basic" runs them
                # over fixed-shape rows, and the first check against the plain path)
                fused_ops.usable = lambda *a, **k: False
            try:
                with torch.inference_mode():
                    for seqs, fill in steps:
                        h = packed_forward(lm, cache, st, graphs, r.device, r.block_size, seqs,
                                           fill)
                        outs.append(lm.logits(h).float())
            finally:
                ta.supported, ta._sm_count = supported, sm_count
                fused_ops.usable = usable
                lm.use_fused = None
            keep = torch.ones(cache.shape[2], dtype=torch.bool)
            keep[scratch] = False
            return torch.cat(outs), cache[:, :, keep].float().clone()

        la, ka = run(None)
        graphs = r.resource(R.CUDA_GRAPHS) if R.CUDA_GRAPHS in r._owner else None
        if graphs is not None:  # CUDA: the real graphs (captured, then replayed: two 64s)
            assert graphs.mixed is not None, "EngineConfig.mixed_cuda_graphs is off"
            replays = graphs.replays  # (the load captured every row count: one replay each)
            lb, kb = run(graphs)
            rows = [k[1] for k in graphs.captured if isinstance(k, tuple)]
            replays = graphs.replays - replays
        else:
            mixed = MixedInputs(max_tokens=st.buffers["input_ids"].shape[0],
                                max_rows=st.buffers["block_tables"].shape[0],
                                table_width=st.buffers["block_tables"].shape[1],
                                scratch_block=scratch, block_size=r.block_size, device=r.device)
            stub = _EagerMixed(mixed, scratch, r.block_size)
            lb, kb = run(stub)
            mixed.close()
            rows, replays = stub.rows, len(stub.rows)
        return {"logits_max_abs": (la - lb).abs().max().item(), "logits_scale": la.abs().max().item(),
                "kv_max_abs": (ka - kb).abs().max().item(), "rows": la.shape[0],
                "mixed_rows": rows, "replays": replays, "argmax_agree": _agree(la, lb)}
    finally:
        r.shutdown()


if __name__ == "__main__":  # python -m tests.fused_check MODEL DEVICE DTYPE -> one JSON line
    import json  # python -m tests.fused_check decode DEVICE
    import sys

    if sys.argv[1] == "decode":
        print(json.dumps({"decode_max_abs": compare_decode(sys.argv[2])}))
    elif sys.argv[1] == "prefill":  # python -m tests.fused_check prefill DEVICE
        print(json.dumps(compare_prefill(sys.argv[2])))
    elif sys.argv[1] == "mixed":  # python -m tests.fused_check mixed MODEL DEVICE [DTYPE [VARIANT]]
        print(json.dumps(compare_mixed(*sys.argv[2:6])))  # [VARIANT]: basic, more
    else:
        print(json.dumps(compare(*sys.argv[1:4])))
