"""An attacker's pass over the grammar worker (``engine/structured/native.py``,
``grammar_worker.cc``, ``TokenBitmask.accept_then_fill``): lifetimes (the host rows dropped by
Python while the C++ thread fills them, a worker never closed), the rows of ended matchers, the
fast and the slow path of ``accept_then_fill``, two workers at once, misuse reported as such,
the process's exit with a job running, the build's cache name, mode and concurrent builds."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
import subprocess
import sys
import textwrap
import time
import weakref

import pytest

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from engine.loader.tokenizer import Tokenizer  # noqa: E402
from engine.ops import native_lib  # noqa: E402
from engine.structured import native  # noqa: E402
from engine.structured.bitmask import TokenBitmask  # noqa: E402
from engine.structured.compiler import _SEPARATORS  # noqa: E402
from engine.structured.grammars import grammar_vocab_size, tokenizer_info  # noqa: E402
from engine.structured.matcher import advance_all, new_matcher  # noqa: E402

V = 512
ROOT = Path(__file__).resolve().parents[1]
needs_worker = pytest.mark.skipif(native.worker_module() is None, reason="no grammar worker")


@pytest.fixture(scope="module")
def grammars():
    tok = Tokenizer.bytes(V)
    comp = xgr.GrammarCompiler(tokenizer_info(tok, V), max_threads=1, cache_enabled=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return tok, [comp.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                          separators=_SEPARATORS),
                 comp.compile_regex("(ab|cd){1,3}x")]


def _words(tok) -> int:
    return -(-grammar_vocab_size(tok, V) // 32)


def _spin_until_done(worker, seconds: float = 20.0) -> bool:
    """Spin while keeping the GIL (a switch interval of 100 s; ``done`` keeps it too): True
    once the worker's job ended. A job that needs the GIL cannot end meanwhile."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        end = time.monotonic() + seconds
        while not worker.done() and time.monotonic() < end:
            pass
        return worker.done()
    finally:
        sys.setswitchinterval(old)


@needs_worker
def test_host_rows_dropped_by_python_mid_job_are_released_by_the_wait(grammars):
    """The host tensor's Python object is dropped while the job runs: the job then holds the
    tensor's last reference (torch hands the Python object's ownership to it), so releasing it
    frees a Python object, which takes the GIL. That must happen in ``wait`` on the caller's
    thread (the worker would otherwise wait for the GIL, i.e. for the step thread, before it
    reports the job done), and the rows must still be filled. The job is held at its start
    (an accept that waits for an event) until the tensor is dropped; the Python object's
    weakref callback says which thread freed it."""
    import threading

    import tvm_ffi

    tok, compiled = grammars
    n = 64
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    ms = [new_matcher(compiled[1]) for _ in range(n)]
    host = torch.zeros((n, _words(tok)), dtype=torch.int32)
    probe = host.untyped_storage()  # the storage only (not the tensor): read after the wait
    freed_on = []
    ref = weakref.ref(host, lambda _: freed_on.append(threading.get_ident()))  # noqa: F841
    go = threading.Event()
    w = native.new_worker()
    real_accept = w._fns[0]

    def held_accept(matchers, tokens, flag):
        assert go.wait(60)
        return real_accept(matchers, tokens, flag)

    w._fns = (tvm_ffi.convert(held_accept),) + w._fns[1:]
    try:
        w.submit(batch, ms, [ord("a")] * n, [], ms, list(range(n)), list(range(n)), host)
        del host
        gc.collect()
        assert not freed_on and not w.done()  # the job holds it
        go.set()
        _, ended, over = w.wait()
        assert ended == [] and over == []
        assert freed_on == [threading.get_ident()]
        rows = torch.tensor([], dtype=torch.int32).set_(probe).view(n, -1)
        b = ord("b")
        assert all((int(rows[k, b >> 5]) >> (b & 31)) & 1 for k in range(n))
        assert not any((int(rows[k, ord("a") >> 5]) >> (ord("a") & 31)) & 1 for k in range(n))
    finally:
        go.set()
        w.close()


@needs_worker
def test_ended_matchers_rows_are_left_alone_on_both_paths(grammars):
    """Matchers fed their stop token end: their rows must not be filled (they keep a sentinel),
    on the fast path (entries = the fed matchers, same order) and on the slow one (entries in
    another order, a matcher not fed, an ended one not fed); every other row equals the step
    thread's own fill, and the verdicts equal ``advance_all``'s."""
    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    eos = new_matcher(compiled[1]).stop_token_ids[0]
    # regex "(ab|cd){1,3}x" after "abx": complete, takes EOS; json after '{"a":1': takes '}'
    prefix = [b"abx", b"ab", b"cdx", b"a", b"cdab"]

    def fresh():
        ms = [new_matcher(compiled[1]) for _ in prefix]
        for m, p in zip(ms, prefix):
            for c in p:
                assert m.accept_token(c)
        return ms

    feed = [eos, ord("c"), eos, ord("b"), ord("x")]  # 0 and 2 end
    for order in ("fast", "reversed", "subset"):
        ms, ref = fresh(), fresh()
        extra, extra_ref = new_matcher(compiled[0]), new_matcher(compiled[0])  # not fed, live
        if order == "fast":
            entries = [(m, k, ()) for k, m in enumerate(ms)]
        elif order == "reversed":
            entries = [(m, k, ()) for k, m in reversed(list(enumerate(ms)))]
        else:  # fed ones partly, one not fed, in another order
            entries = [(ms[2], 2, ()), (extra, 5, ()), (ms[0], 0, ()), (ms[3], 3, ())]
        bits = TokenBitmask(8, V, "cpu", grammar_vocab=gv)
        bits.host.fill_(-7)  # the sentinel: a row the job must not fill keeps it
        try:
            job = bits.accept_then_fill(ms, feed, entries)
            assert job is not None
            ended, rows = job.result()
        finally:
            bits._worker and bits._worker.close()
        verdicts = advance_all(ref, feed)
        want_ended = {k for k, v in enumerate(verdicts) if v[0] == "stop"}
        assert want_ended == {0, 2}
        assert {k for k, m in enumerate(ms) if id(m) in ended} == want_ended
        want_rows = [r for m, r, _ in entries if r == 5 or r not in want_ended]
        assert rows == want_rows, order
        for r in range(8):
            if r not in want_rows:
                assert bool((bits.host[r] == -7).all()), (order, r, "filled")
        ref_bits = TokenBitmask(8, V, "cpu", grammar_vocab=gv)
        ref_entries = [(ref[r] if r < 5 else extra_ref, r, ()) for r in want_rows]
        ref_bits.fill(ref_entries, background=False)
        for r in want_rows:
            assert torch.equal(bits.host[r], ref_bits.host[r]), (order, r)
        bits.close()
        ref_bits.close()


@needs_worker
def test_two_workers_interleaved(grammars):
    """Two workers (two engines' bitmasks) with jobs at once, waited for in the other order:
    each gets its own job's result and rows."""
    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    a, b = (TokenBitmask(64, V, "cpu", grammar_vocab=gv) for _ in range(2))
    ma = [new_matcher(compiled[1]) for _ in range(64)]
    mb = [new_matcher(compiled[1]) for _ in range(32)]
    ja = a.accept_then_fill(ma, [ord("a")] * 64, [(m, k, ()) for k, m in enumerate(ma)])
    jb = b.accept_then_fill(mb, [ord("c")] * 32, [(m, k, ()) for k, m in enumerate(mb)])
    assert jb.result() == (set(), list(range(32)))
    assert ja.result() == (set(), list(range(64)))
    for bits, want in ((a, ord("b")), (b, ord("d"))):
        n = 64 if bits is a else 32
        allowed = [t for t in range(gv) if (int(bits.host[n - 1, t >> 5]) >> (t & 31)) & 1]
        assert allowed == [want]
    a.close()
    b.close()


@needs_worker
def test_a_wait_without_a_job_is_reported_as_such(grammars):
    """``wait`` with no job submitted (or a job's result asked twice) is misuse: a clear
    RuntimeError, not an IndexError from an empty result."""
    tok, compiled = grammars
    w = native.new_worker()
    try:
        with pytest.raises(RuntimeError, match="no job"):
            w.wait()
    finally:
        w.close()
    bits = TokenBitmask(4, V, "cpu", grammar_vocab=grammar_vocab_size(tok, V))
    m = new_matcher(compiled[1])
    job = bits.accept_then_fill([m], [ord("a")], [(m, 0, ())])
    assert job.result() == (set(), [0])
    with pytest.raises(RuntimeError, match="no job"):
        job.result()
    bits.close()


@needs_worker
def test_a_non_contiguous_bitmask_is_refused(grammars):
    """xgrammar fills row r at r x width words: a strided view would get its rows in the wrong
    place (silently). Refused at the submit."""
    tok, compiled = grammars
    w = native.new_worker()
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    m = new_matcher(compiled[1])
    big = torch.zeros((4, 2 * _words(tok)), dtype=torch.int32)
    try:
        with pytest.raises(ValueError, match="contiguous"):
            w.submit(batch, [], [], [], [m], [1], [-1], big[:, : _words(tok)])
    finally:
        w.close()


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@needs_worker
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc")
def test_a_worker_dropped_unclosed_ends_its_thread(grammars):
    """A bitmask never closed (its worker dropped): the worker's C++ thread ends once the worker
    is collected, after its job (not leaked for the process's life)."""
    tok, compiled = grammars
    gc.collect()
    before = _native_threads()
    w = native.new_worker()
    assert _native_threads() == before + 1
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    ms = [new_matcher(compiled[1]) for _ in range(256)]
    host = torch.zeros((256, _words(tok)), dtype=torch.int32)
    w.submit(batch, ms, [ord("a")] * 256, [], ms, list(range(256)), list(range(256)), host)
    del w
    gc.collect()
    assert _native_threads() == before
    assert all(m.accept_token(ord("b")) for m in ms)  # the job ran before the thread ended


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, xgrammar as xgr
    from engine.structured import native
    from engine.structured.bitmask import TokenBitmask
    from engine.structured.grammars import grammar_vocab_size, tokenizer_info
    from engine.structured.matcher import new_matcher
    from engine.loader.tokenizer import Tokenizer
    tok = Tokenizer.bytes(512)
    comp = xgr.GrammarCompiler(tokenizer_info(tok, 512), max_threads=1, cache_enabled=False)
    g = comp.compile_builtin_json_grammar()
    n = 20000
    bits = TokenBitmask(n, 512, "cpu", grammar_vocab=grammar_vocab_size(tok, 512))
    ms = [new_matcher(g) for _ in range(n)]
    entries = [(m, k, ()) for k, m in enumerate(ms)]
    job = bits.accept_then_fill(ms, [ord("{")] * n, entries)
    assert job is not None
    print("running" if not bits._worker.done() else "done", flush=True)
    if sys.argv[1] == "drop":
        del job, bits, ms, entries
    # never waited, never closed: the interpreter ends with the worker's thread alive
""")


@needs_worker
@pytest.mark.parametrize("how", ["keep", "drop"])
def test_the_process_exits_with_a_job_running_and_the_worker_never_closed(how, tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script), how], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() in ("running", "done")


class _Libinfo:
    """tvm-ffi's libinfo, real paths (only the compiler run is faked)."""

    def __init__(self):
        import tvm_ffi.libinfo as real

        self.find_libtvm_ffi = real.find_libtvm_ffi
        self.find_include_path = real.find_include_path
        self.find_dlpack_include_path = real.find_dlpack_include_path


def test_the_cached_library_name_covers_the_build_command(tmp_path, monkeypatch):
    """The cached ``.so`` is reused by name: a change of compiler flags or of compiler must give
    another name (else a library built another way is loaded, stale)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = []

    def fake_run(cmd, **kw):
        builds.append(cmd)
        Path(cmd[-1]).write_bytes(b"built")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(native_lib.subprocess, "run", fake_run)
    first = native._library(_Libinfo())
    assert native._library(_Libinfo()) == first and len(builds) == 1  # cached
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-DNDEBUG",))
    second = native._library(_Libinfo())
    assert second != first and len(builds) == 2 and "-DNDEBUG" in builds[1]
    monkeypatch.setenv("CXX", "g++" if Path(builds[0][0]).name != "g++" else "clang++")
    if native_lib.shutil.which(os.environ["CXX"]) is not None:
        assert native._library(_Libinfo()) not in (first, second)


def test_the_built_library_is_readable_by_the_caches_other_users(tmp_path, monkeypatch):
    """The build goes through a ``mkstemp`` file (mode 0600, kept by the linker): the library
    must end up with the mode a compiler-made file has (0755 less the umask), or another user
    of a shared cache cannot load it (the worker then silently stays off for them)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def fake_run(cmd, **kw):  # like ld: writes into the existing file, adds x for its owner
        Path(cmd[-1]).write_bytes(b"built")
        os.chmod(cmd[-1], os.stat(cmd[-1]).st_mode | 0o100)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(native_lib.subprocess, "run", fake_run)
    old = os.umask(0o022)
    try:
        out = native._library(_Libinfo())
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o755


@pytest.mark.skipif(native_lib.shutil.which("c++") is None or not sys.platform.startswith("linux"),
                    reason="no C++ compiler")
def test_two_processes_build_into_one_cache_at_once(tmp_path):
    """Two processes build the worker into an empty cache at the same time: both load it, one
    library is left, no temporary file."""
    code = ("from engine.structured import native; import sys; "
            "sys.exit(0 if native.worker_module() is not None else 3)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_EXTENSIONS_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("enginecore_grammar_worker_"), files
    assert os.stat(tmp_path / files[0]).st_mode & 0o044 == 0o044 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@needs_worker
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_forked_child_leaves_its_copy_of_a_worker_alone(how, grammars):
    """A process forked while a worker's job runs has a copy of the worker without its thread:
    closing that copy in the child must not wait for the job (no thread will end it: a hang),
    nor touch the parent's thread; collecting it must not either (``_free_here``; on glibc the
    join itself returns in a child, so only a mutex copied locked would hang there -- racy,
    so the "drop" case guards rather than proves). The parent's job and worker are
    unaffected."""
    import threading
    import warnings

    import tvm_ffi

    tok, compiled = grammars
    bits = TokenBitmask(8, V, "cpu", grammar_vocab=grammar_vocab_size(tok, V))
    bits._worker = native.new_worker()
    go = threading.Event()  # the job is held at its start until the child has ended
    real_accept = bits._worker._fns[0]

    def held_accept(matchers, tokens, flag):
        assert go.wait(120)
        return real_accept(matchers, tokens, flag)

    bits._worker._fns = (tvm_ffi.convert(held_accept),) + bits._worker._fns[1:]
    m = new_matcher(compiled[1])
    job = bits.accept_then_fill([m], [ord("a")], [(m, 0, ())])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the test's own
        pid = os.fork()
    if pid == 0:  # the child: only os._exit, whatever happens
        code = 1
        try:
            if how == "close":
                bits.close()
            else:
                bits._worker = None
                del job
                gc.collect()
            code = 0
        finally:
            os._exit(code)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        go.set()
        pytest.fail("the child hung on its copy of the worker")
    go.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert job.result() == (set(), [0])
    bits.close()
