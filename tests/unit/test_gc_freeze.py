"""engine/runner/gc_freeze.py: a loaded runner keeps the cyclic collector off the startup heap, and
gives it back at shutdown -- the last of two runners, not the first."""

import gc

import pytest

from engine.config import EngineConfig
from engine.runner import gc_freeze
from engine.runner.model_runner import ModelRunner


@pytest.fixture(autouse=True)
def _thawed():
    if gc_freeze.holders():  # a runner of an earlier test still loaded (not shut down)
        pytest.skip("another runner in this process holds a freeze")
    assert gc.get_freeze_count() == 0
    yield
    while gc_freeze.holders():
        gc_freeze.release()
    gc.unfreeze()


def _runner(**kw) -> ModelRunner:
    r = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=16, **kw))
    r.load()
    return r


def test_a_loaded_runner_freezes_the_heap_until_its_shutdown():
    import weakref

    class Cycle:
        pass

    r = _runner()
    assert gc_freeze.holders() == 1 and gc.get_freeze_count() > 1000  # the model, torch, ...
    # a cycle frozen while the engine serves: collections skip it (made here, then frozen as
    # the load froze everything alive then)
    c = Cycle()
    c.me = c
    gone = weakref.ref(c)
    gc.freeze()
    del c
    gc.collect()
    assert gone() is not None
    r.shutdown()
    assert gc_freeze.holders() == 0 and gc.get_freeze_count() == 0
    assert gone() is None  # thawed before the release's own collection, which took it
    r.shutdown()  # a second shutdown thaws nothing more
    assert gc_freeze.holders() == 0


def test_two_runners_compose_and_the_option_turns_it_off():
    a, b = _runner(), _runner()
    assert gc_freeze.holders() == 2
    a.shutdown()
    assert gc_freeze.holders() == 1 and gc.get_freeze_count() > 0  # b still serves frozen
    b.shutdown()
    assert gc.get_freeze_count() == 0
    c = _runner(freeze_gc=False)
    assert gc_freeze.holders() == 0 and gc.get_freeze_count() == 0
    c.shutdown()


def test_the_young_threshold_is_raised_while_serving_and_given_back():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        a = _runner(gc_young_threshold=20_000)
        assert gc.get_threshold() == (20_000, *before[1:])
        b = _runner(gc_young_threshold=500)  # never lowered by a second engine
        assert gc.get_threshold()[0] == 20_000
        a.shutdown()
        assert gc.get_threshold()[0] == 20_000  # b still serves
        b.shutdown()
        assert gc.get_threshold() == (700, *before[1:])  # the interpreter's, back
        c = _runner(gc_young_threshold=0)  # 0: left alone
        assert gc.get_threshold()[0] == 700
        c.shutdown()
        gc.set_threshold(0)  # automatic collection off (the process's choice): left off
        d = _runner()
        assert gc.get_threshold()[0] == 0
        d.shutdown()
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def test_the_young_threshold_is_range_checked():
    from engine.errors import BadRequestError

    with pytest.raises(BadRequestError, match="gc_young_threshold"):
        EngineConfig(model="random:tiny-llama", gc_young_threshold=-1).validate()
    with pytest.raises(BadRequestError, match="gc_young_threshold"):
        EngineConfig(model="random:tiny-llama", gc_young_threshold=10**8).validate()


def test_thresholds_the_process_set_while_serving_are_left_at_shutdown():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        a = _runner(gc_young_threshold=20_000)
        b = _runner(gc_young_threshold=30_000)  # raised further by the second engine
        assert gc.get_threshold()[0] == 30_000
        a.shutdown()
        b.shutdown()
        assert gc.get_threshold() == (700, 10, 10)  # the thresholds before the first engine
        c = _runner(gc_young_threshold=20_000)
        gc.set_threshold(1_234, 5, 5)  # the process's own choice while c serves
        c.shutdown()
        assert gc.get_threshold() == (1_234, 5, 5)  # kept, not overwritten
    finally:
        gc.set_threshold(*before)


def test_the_process_own_thresholds_are_neither_raised_nor_overwritten():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        gc_freeze.hold(10_000)
        gc.set_threshold(10_000, 50, 50)  # only the older generations changed by the process
        gc_freeze.release()
        assert gc.get_threshold() == (10_000, 50, 50)
        gc.set_threshold(700, 10, 10)
        gc_freeze.hold(20_000)
        gc.set_threshold(5_000)  # the process's own, while held
        gc_freeze.hold(10_000)  # a second engine: not raised over the process's choice
        assert gc.get_threshold()[0] == 5_000
        gc_freeze.release()
        gc_freeze.release()
        assert gc.get_threshold()[0] == 5_000
    finally:
        while gc_freeze.holders():
            gc_freeze.release()
        gc.set_threshold(*before)


def test_the_default_young_threshold():
    assert EngineConfig(model="random:tiny-llama").gc_young_threshold == 2_000
