"""Shared fixtures: random-weight Hugging Face checkpoints written by transformers itself."""

from __future__ import annotations

import os
from pathlib import Path

# NOTE: the suite runs engines in this process and in `enginecore serve` subprocesses at once on
# a 2-core CI machine; several OpenMP pools spinning against each other made steps ~100x slower.
# One intra-op thread per process (inherited by subprocesses) keeps timings sane.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import fcntl  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# -- tests that run alone -------------------------------------------------------------------
# scripts/test.sh runs the suite on pytest-xdist workers (two on CI's two cores). A test marked
# ``alone`` asserts wall-clock bounds (a reply within N s, a step's pace) or what another
# thread gets done meanwhile, which another worker's test on the same cores would stretch or
# starve: while it runs, no other worker runs a test. Every test
# takes a shared lock around its setup, call and teardown, an ``alone`` test the exclusive one;
# a turnstile lock taken before either keeps a waiting ``alone`` test from being starved by
# the other worker's next tests. Without xdist (one process) the locks are not taken.
# An ``alone`` test that asks for the ``alone_from_here`` fixture runs its unmeasured start (a
# model load, a server's start) beside the other worker's tests, under the shared lock, and
# takes the exclusive one when it calls the fixture's value, before it measures anything.
#
# Each exclusive lock waits for the other worker's test of the moment to end (often one of
# the long ones: seconds each time). So under xdist the ``alone`` tests come first in the
# collection, one after another (xdist's work stealing hands each worker a contiguous part and
# steals from the end), and a worker keeps the exclusive lock from one ``alone`` test into the
# next: the other worker waits once for the run of them, not once a test.

_LOCKS = pytest.StashKey[tuple]()
_HELD = {"fds": None, "exclusive": False}  # this worker's lock files, and what it holds


def _run_lock_paths():
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not run:
        return None
    base = os.path.join(tempfile.gettempdir(), f"enginecore-tests-{run}")
    return base + ".turn", base + ".lock"


def _alone_rank(item) -> int:
    """0: ``alone`` throughout; 1: ``alone`` from a point on (``alone_from_here``); 2: not."""
    if item.get_closest_marker("alone") is None:
        return 2
    return 1 if "alone_from_here" in getattr(item, "fixturenames", ()) else 0


#: Modules of many short tests (none over a few seconds). Under xdist they are placed where the
#: second worker's part of the collection begins: while the first worker runs the ``alone``
#: tests, each exclusive lock waits for the second worker's test of the moment, which is then
#: a short one (a long one there kept the first worker waiting up to ~40 s a time, one core idle).
_SHORT_TESTS = ("tests/unit/", "tests/ipc/", "tests/test_states.py", "tests/test_no_pickle.py",
                "tests/test_docs.py", "tests/test_mailbox.py")


def _short(item) -> bool:
    path = Path(str(item.path)).resolve().relative_to(Path(__file__).resolve().parents[1])
    return path.as_posix().startswith(_SHORT_TESTS)


def _first_chunk(n: int) -> int:
    """Tests in each worker's first chunk: xdist's ``load`` scheduling (3.x) hands worker i
    ``items[i * c:(i + 1) * c]`` first, ``c`` a quarter of a worker's share, then the rest a
    few at a time to whichever worker runs low."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "2")))
    return max(2, n // workers // 4)


def pytest_collection_modifyitems(config, items):
    if _run_lock_paths() is None:  # (every worker sorts alike: xdist checks they agree)
        return
    items.sort(key=_alone_rank)  # stable: the files' order within each kind
    # the first worker's first chunk starts with the ``alone`` tests; the second worker's first
    # chunk is the short modules, whole (module fixtures kept). Placed at n // 2 instead (what
    # an older scheduler handed the second worker first), they came late: the ``alone`` tests'
    # locks waited for long tests, ~75 s of one idle core a run (measured, 2 cores).
    alone = [i for i in items if _alone_rank(i) < 2]
    short = [i for i in items[len(alone):] if _short(i)]
    other = [i for i in items[len(alone):] if not _short(i)]
    cut = max(0, _first_chunk(len(items)) - len(alone))
    items[:] = alone + other[:cut] + short + other[cut:]


def _take(exclusive: bool) -> None:
    turn, lock = _HELD["fds"]
    # whatever this worker holds is let go first: the other worker may hold the turnstile
    # while it waits for this worker's lock
    fcntl.flock(lock, fcntl.LOCK_UN)
    fcntl.flock(turn, fcntl.LOCK_EX)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    finally:
        fcntl.flock(turn, fcntl.LOCK_UN)
    _HELD["exclusive"] = exclusive


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    paths = _run_lock_paths()
    if paths is None:
        return (yield)
    if _HELD["fds"] is None:
        _HELD["fds"] = tuple(os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in paths)
    item.stash[_LOCKS] = _HELD["fds"]
    exclusive = _alone_rank(item) == 0
    if not (exclusive and _HELD["exclusive"]):  # (else held on from the test before)
        _take(exclusive)
    try:
        return (yield)
    finally:
        if not (_HELD["exclusive"] and nextitem is not None and _alone_rank(nextitem) == 0):
            fcntl.flock(_HELD["fds"][1], fcntl.LOCK_UN)
            _HELD["exclusive"] = False


@pytest.fixture
def alone_from_here(request):
    """For an ``alone`` test: call the value (``go()``; in a coroutine through
    ``anyio.to_thread.run_sync(go)``, the event loop serving on) once its unmeasured start is done;
    from then on to its end no other worker runs a test. Calling it is required."""
    assert request.node.get_closest_marker("alone") is not None, "alone_from_here needs @alone"
    locked = request.node.stash.get(_LOCKS, None) is not None
    called: list[bool] = []

    def go() -> None:
        assert not called, "alone_from_here called twice"
        called.append(True)
        if locked:  # (one process: no locks)
            _take(True)

    yield go
    if not request.node.stash.get(_CALL_FAILED, False):  # (a failure before it says enough)
        assert called, "an alone_from_here test never called it: it ran beside other tests"


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_CALL_FAILED] = True
    return report


def pytest_sessionfinish(session):
    # the xdist controller, its workers done: what they shared in the run's temporary directory
    # (tests/test_gguf_loader.py: transformers' load of the default model, ~0.5 GB) goes
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config,
                                                                           "workerinput"):
        shutil.rmtree(session.config._tmp_path_factory.getbasetemp() / "hf-gguf-load",
                      ignore_errors=True)


def pytest_unconfigure(config):
    # a worker that is done runs no more tests: whichever comes first removes the lock files
    # (the others keep theirs open: they still exclude each other)
    for path in _run_lock_paths() or ():
        try:
            os.unlink(path)
        except OSError:
            pass

# -- the default model's file, read once a test process ------------------------------------------
# NOTE: reading SmolLM2's GGUF file (gguf's reader parsing the metadata and vocabulary, the
# weights dequantized) is ~3.4 s of the default model's ~5 s load, and dozens of tests open the
# default model in process. The engine's reads of that file (``resolve_source``: with ``types_out``)
# after the first in a test process get the first one's outputs anew: a weights dict of cloned
# tensors (the loader drains it), the types, the same config and tokenizer (neither is changed
# by the engine; the tokenizer's caches are derived from it). Direct calls (tests of the loader
# itself) and other files read the file; so does every process the tests start.
@pytest.fixture(scope="session", autouse=True)
def _default_gguf_read_once():
    from engine.loader import gguf_loader

    real, memo = gguf_loader.load_gguf, {}

    def load_gguf(path, types_out=None):
        try:
            default = types_out is not None and Path(path) == gguf_loader.default_model_path()
        except Exception:  # (no default model installed: the real read says so)
            default = False
        if not default:
            return real(path, types_out)
        st = os.stat(path)
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in memo:
            memo.clear()
            types: dict[str, str] = {}
            memo[key] = (real(path, types), types)
        (cfg, weights, tok), types = memo[key]
        types_out.update(types)
        return cfg, {k: v.clone() for k, v in weights.items()}, tok

    gguf_loader.load_gguf = load_gguf
    yield
    gguf_loader.load_gguf = real


# Small enough to build and run in milliseconds, big enough to exercise GQA, several KV blocks
# and multi-layer caches. Architecture-specific knobs are passed as overrides.
TINY_HF_CONFIG = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A trivial WordLevel tokenizer.json: token ``t<i>`` is id ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def write_hf_checkpoint(path: Path, arch: str = "LlamaForCausalLM", *, seed: int = 0,
                        std: float = 0.15, max_shard_size=None, **overrides):
    """Build ``arch`` with transformers from TINY_HF_CONFIG + ``overrides``, with N(0, std)
    weights from ``seed`` (large std -> peaky logits, so greedy argmax has no near-ties), and
    ``save_pretrained`` it (safetensors) plus a tokenizer.json into ``path``.

    Returns the fp32 transformers model (eval mode), the reference for parity tests."""
    import transformers

    model_cls = getattr(transformers, arch)
    config_cls = model_cls.config_class
    config = config_cls(**{**TINY_HF_CONFIG, "initializer_range": std, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms are initialised to 1 and biases to 0; randomise them too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, std)
    path.mkdir(parents=True, exist_ok=True)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kw)
    write_tokenizer(path, config.vocab_size)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory ``hf_checkpoint(name, arch, **kw) -> (path, hf_model)``, cached per name."""
    cache: dict[str, tuple[Path, object]] = {}

    def make(name: str, arch: str = "LlamaForCausalLM", **kw):
        if name not in cache:
            path = tmp_path_factory.mktemp("ckpt") / name
            cache[name] = (path, write_hf_checkpoint(path, arch, **kw))
        return cache[name]

    return make


@pytest.fixture(scope="module")
def torch_one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    waiting makes every small op many times slower. Opt in per module (``usefixtures``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def inject_fault():
    """``inject_fault(n)``: every model runner's forward raises on its ``n``-th step while the
    test runs (tests/faults.py); disarmed after it."""
    from tests.faults import arm

    undo: list = []

    def fault_at(step: int) -> None:
        undo.append(arm(step))

    yield fault_at
    for disarm in reversed(undo):
        disarm()
