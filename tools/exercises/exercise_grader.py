"""The exercise grader's pytest plugin (tools/exercises/exercise.py copies it into DIR/.exercise/ and loads it
with `-p exercise_grader`); it works with the pytest of any stage.

    --exercise-report=FILE    one JSON line per test as it finishes: {"nodeid", "outcome", "message", "seconds"},
                              outcome passed | failed | error | skipped; collection errors are errors too
    --exercise-timeout=S      a test whose setup, call and teardown run longer fails, so that a stub that
                              leaves a server or a worker waiting cannot hang the grader

The timeout: a watchdog thread counts the seconds the test's phases have run (one tick a second, so a
process that was stopped and continued does not time out at once) and then sends SIGALRM to the main
thread, which interrupts a wait there; the handler calls `pytest.fail`, whose exception is a
BaseException, so code under test that catches Exception cannot swallow it. Between phases (pytest's own
reporting) it is disarmed, so it never fires inside pytest itself.
"""

from __future__ import annotations

import json
import signal
import threading
import time

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
        self.armed = False  # inside a phase (setup, call, teardown) of a test
        self.ticks = 0  # seconds the current test has run while armed
        if timeout > 0:
            signal.signal(signal.SIGALRM, self._expire)
            threading.Thread(target=self._watch, args=(threading.main_thread().ident,), daemon=True).start()

    def _watch(self, main: int) -> None:
        while True:
            time.sleep(1)
            if self.armed:
                self.ticks += 1
                if self.ticks == int(self.timeout):
                    signal.pthread_kill(main, signal.SIGALRM)

    def _expire(self, signum, frame) -> None:
        if self.armed:
            pytest.fail(f"timed out after {self.timeout:g} s (the grader's limit per test)", pytrace=False)

    def write(self, nodeid: str, outcome: str, message: str = "", seconds: float = 0.0) -> None:
        if self.report is not None:
            rec = {"nodeid": nodeid, "outcome": outcome, "message": message, "seconds": round(seconds, 2)}
            self.report.write(json.dumps(rec) + "\n")
            self.report.flush()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.ticks = 0
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        self.armed = True
        yield
        self.armed = False

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        self.armed = True
        yield
        self.armed = False

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        self.armed = True
        yield
        self.armed = False

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
