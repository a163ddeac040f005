"""The exercise grader's pytest plugin (scripts/exercise.py copies it into DIR/.exercise/ and loads it
with `-p exercise_grader`); it works with the pytest of any stage.

    --exercise-report=FILE    one JSON line per test as it finishes: {"nodeid", "outcome", "message", "seconds"},
                              outcome passed | failed | error | skipped; collection errors are errors too
    --exercise-timeout=S      a test (setup, call and teardown) that runs longer fails, so that a stub
                              that leaves a server or a worker waiting cannot hang the grader

The timeout is a SIGALRM timer in the main thread; its handler calls `pytest.fail`, whose exception is
a BaseException: code under test that catches Exception cannot swallow it.
"""

from __future__ import annotations

import json
import signal

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("exercise")
    group.addoption("--exercise-report", default=None, help="write one JSON line per test here")
    group.addoption("--exercise-timeout", type=float, default=0, help="seconds per test (0: none)")


class _Grader:
    def __init__(self, report: str | None, timeout: float):
        self.report = open(report, "a") if report else None  # noqa: SIM115 (closed at session end)
        self.timeout = timeout
        self.setup_seconds = 0.0  # of the test being run

    def write(self, nodeid: str, outcome: str, message: str = "", seconds: float = 0.0) -> None:
        if self.report is not None:
            rec = {"nodeid": nodeid, "outcome": outcome, "message": message, "seconds": round(seconds, 2)}
            self.report.write(json.dumps(rec) + "\n")
            self.report.flush()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.timeout <= 0:
            yield
            return

        def expire(signum, frame):
            signal.setitimer(signal.ITIMER_REAL, 0)
            pytest.fail(f"timed out after {self.timeout:g} s (the grader's limit per test)", pytrace=False)

        old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def pytest_runtest_logreport(self, report):
        # one record per test: its call, or the setup/teardown that failed (or skipped it)
        if report.when == "setup":
            self.setup_seconds = report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome if report.when == "call" else ("skipped" if report.skipped else "error")
            seconds = report.duration + (self.setup_seconds if report.when == "call" else 0.0)
            self.write(report.nodeid, outcome, _message(report), seconds)
        elif report.when == "teardown" and report.failed:
            self.write(report.nodeid, "error", "teardown: " + _message(report))

    def pytest_collectreport(self, report):
        if report.failed:
            self.write(report.nodeid or "collection", "error", "collection: " + _message(report))

    def pytest_sessionfinish(self, session):
        if self.report is not None:
            self.report.close()


def _message(report) -> str:
    """One line: the exception that ended the test (or the reason it was skipped)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[0][:200] if lines else ""


def pytest_configure(config):
    config.pluginmanager.register(
        _Grader(config.getoption("exercise_report"), config.getoption("exercise_timeout")), "exercise-grader"
    )
