"""The integration tests skip where their framework cannot be imported, except in CI.

``OPD_REQUIRE_INTEGRATIONS=1`` (set by ``.ci/run`` in the TRL and verl environments) turns such a
skip into a failure: an environment that lacks a module the framework imports (verl's
distillation losses import ``datasets``, for one) would otherwise pass by testing nothing.
"""

import os

import pytest

REQUIRED = os.environ.get("OPD_REQUIRE_INTEGRATIONS") == "1"


def _required(report, where):
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"{where} skipped, but OPD_REQUIRE_INTEGRATIONS=1 requires it: "
                           f"{reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _required(outcome.get_result(), collector.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _required(outcome.get_result(), item.nodeid)
