"""The GPU suite's one hook: a failure is printed in full as it happens, not only in the summary
at the end (the lent machine's runs end at a time budget, and a run stopped there never prints
its summary)."""

from __future__ import annotations

_config: list = []


def pytest_configure(config):
    _config.append(config)


def pytest_runtest_logreport(report):
    if report.failed and _config:
        reporter = _config[0].pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n== FAILED {report.nodeid} ({report.when})")
            reporter.write_line(report.longreprtext[-6000:])
