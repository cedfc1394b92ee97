"""Intra-op threads from the CPUs the process may use (engine/cpu_threads.py)."""

import os

import pytest

from engine import cpu_threads
from engine.cpu_threads import cgroup_cpu_quota, choose_threads, cpu_budget


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

    code = ("import os, torch; n = torch.get_num_threads(); import engine.cpu_threads, engine.runner; "
            "assert torch.get_num_threads() == n and os.environ.get('OMP_NUM_THREADS') == '5'")
    env = {**os.environ, "OMP_NUM_THREADS": "5"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
