"""Intra-op threads from the CPUs the process may use (engine/serving/cpu_threads.py)."""

import os

import pytest

from engine.serving import cpu_threads
from engine.serving.cpu_threads import cgroup_cpu_quota, choose_threads, cpu_budget


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_budget_is_affinity_capped_by_quota(monkeypatch):
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    n, why = cpu_budget()
    assert n == len(os.sched_getaffinity(0)) and "sched_getaffinity" in why
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 0.3)
    assert cpu_budget()[0] == 1 and "quota" in cpu_budget()[1]


def test_choose_threads_precedence(monkeypatch):
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    assert choose_threads(3, {"OMP_NUM_THREADS": "1"}) == (3, "--threads")
    assert choose_threads(None, {"OMP_NUM_THREADS": "2"}) == (2, "$OMP_NUM_THREADS")
    assert choose_threads(None, {})[0] == max(1, len(os.sched_getaffinity(0)) - 1)
    with pytest.raises(ValueError):
        choose_threads(0)


def test_default_leaves_one_cpu():
    assert [cpu_threads.default_threads(n) for n in (1, 2, 3, 16)] == [1, 1, 2, 15]


def test_import_sets_nothing():
    # the library never changes process state on import: only apply_threads() does
    import subprocess
    import sys

    code = ("import os, torch; n = torch.get_num_threads(); import engine.serving.cpu_threads, engine.runner.model_runner; "
            "assert torch.get_num_threads() == n and os.environ.get('OMP_NUM_THREADS') == '5'")
    env = {**os.environ, "OMP_NUM_THREADS": "5"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


class _Machine:
    """A fake clock and /proc readings: ``others`` CPUs' worth of other processes' work and
    ``own`` of ours accrue as time passes."""

    def __init__(self):
        self.t, self.busy, self.own, self.others, self.ours = 0.0, 0, 0, 0.0, 1.0

    def advance(self, seconds: float) -> None:
        hz = cpu_threads._CLK_TCK
        self.t += seconds
        self.busy += round((self.others + self.ours) * seconds * hz)
        self.own += round(self.ours * seconds * hz)

    def read(self, cpus):
        return self.busy, self.own


def _governor(m: _Machine, ceiling=2, threads=1):
    applied = []
    g = cpu_threads.ThreadGovernor(ceiling, period=0.1, cpus=[0, 1], clock=lambda: m.t,
                                   read=m.read, set_threads=applied.append, threads=threads)
    return g, applied


def test_governor_uses_free_cpus_up_after_two_readings_down_at_once():
    m = _Machine()
    g, applied = _governor(m)
    g.tick()  # the first reading: nothing to compare with yet
    m.advance(0.2)
    assert g.tick() == 1 and applied == []  # one reading asks for 2: not yet
    m.advance(0.05)
    assert g.tick() == 1  # within the period: no reading
    m.advance(0.1)
    assert g.tick() == 2 and applied == [2]  # the second reading in a row
    m.others = 1.0  # a busy neighbour on one of the two CPUs
    m.advance(0.2)
    assert g.tick() == 1 and applied == [2, 1] and g.others == pytest.approx(1.0, abs=0.06)
    m.others = 0.6  # more than half a CPU taken: still one thread
    m.advance(0.2)
    assert g.tick() == 1
    m.others = 0.0
    for _ in range(2):
        m.advance(0.2)
        g.tick()
    assert applied == [2, 1, 2] and g.changes == 3


def test_governor_never_goes_past_its_ceiling_or_below_one():
    m = _Machine()
    m.ours = 0.0
    g, applied = _governor(m, ceiling=1, threads=1)
    for _ in range(5):
        m.advance(0.2)
        g.tick()
    assert applied == []
    m.others = 2.0
    g2, applied2 = _governor(m, ceiling=2, threads=2)
    for _ in range(3):
        m.advance(0.2)
        g2.tick()
    assert applied2 == [1]


def test_governor_without_proc_leaves_the_count():
    g = cpu_threads.ThreadGovernor(2, period=0.0, cpus=[0, 1], read=lambda cpus: None,
                                   set_threads=lambda n: pytest.fail("set"), threads=1)
    assert g.tick() == 1 and g.tick() == 1


def test_proc_readings_count_this_process():
    reading = cpu_threads._busy_and_own_ticks(sorted(os.sched_getaffinity(0)))
    assert reading is not None and reading[0] >= reading[1] >= 0


def test_adaptive_ceiling_only_for_the_default_count(monkeypatch):
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(cpu_threads, "_affinity", lambda: 4)
    assert cpu_threads.adaptive_ceiling({}) == 4
    assert cpu_threads.adaptive_ceiling({"OMP_NUM_THREADS": "3"}) is None
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 2.0)
    assert cpu_threads.adaptive_ceiling({}) is None
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(cpu_threads, "_affinity", lambda: 1)
    assert cpu_threads.adaptive_ceiling({}) is None


def test_config_carries_the_ceiling_from_the_entry_point():
    import argparse

    import msgspec

    from engine.config import EngineConfig
    from engine.errors import BadRequestError
    from entrypoints.args import add_model_args, config_from_args

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    a = ap.parse_args([])
    a.config_json = None
    a.cpu_threads_max = 2
    assert config_from_args(a).cpu_threads_max == 2
    a.config_json = msgspec.json.encode(EngineConfig(model="random:tiny-llama")).decode()
    assert config_from_args(a).cpu_threads_max == 2
    with pytest.raises(BadRequestError, match="cpu_threads_max"):
        EngineConfig(cpu_threads_max=0).validate()


@pytest.mark.asyncio
async def test_async_engine_ticks_the_governor_before_each_cpu_step(monkeypatch):
    from engine import AsyncEngine, SamplingParams
    from engine.config import EngineConfig

    ticks = []

    class Counting:
        def __init__(self, ceiling):
            self.ceiling = ceiling

        def tick(self):
            ticks.append(self.ceiling)
            return 1

    monkeypatch.setattr(cpu_threads, "ThreadGovernor", Counting)
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", cpu_threads_max=2, num_kv_blocks=32)
    async with AsyncEngine.open(cfg) as eng:
        async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)):
            pass
    assert len(ticks) >= 4 and set(ticks) == {2}
