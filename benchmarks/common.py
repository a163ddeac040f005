"""What the benchmarks, tools and tests share: a free port, a server started and waited for until it is healthy,
the loop that steps an engine until its requests are done, percentiles, a call's median time, and the checkout's
git commit.

    from benchmarks.common import REPO, drain, finished_tokens, free_port, git, percentile, start_server, wait_healthy
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(extra: dict | None = None) -> dict[str, str]:
    """The environment a server child runs in: this checkout's roseinfer importable, no model-hub downloads."""
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(extra or {})}


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (what every result names its machine by); platform's guess
    where there is no such file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown"


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float = 120.0, paths: Iterable[str] = ("/health",),
                 what: str = "the server", log: Path | None = None, interval: float = 0.1) -> None:  # fmt: skip
    """Poll GET base_url + each of `paths` until all answer 200. RuntimeError if `proc` exits first or `timeout`
    seconds pass (with the end of `log`, if there is one)."""
    import httpx

    def failed(why: str) -> RuntimeError:
        tail = f"; {log} ends:\n{log.read_text(errors='replace')[-3000:]}" if log is not None and log.exists() else ""
        return RuntimeError(f"{what} {why}{tail}")

    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise failed(f"exited with {proc.returncode}")
        try:
            if all(httpx.get(base_url + path, timeout=5).status_code == 200 for path in paths):
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)
    raise failed(f"did not answer {' and '.join(paths)} within {timeout:g} s")


def start_server(cmd: list[str], port: int, *, log: Path | None = None, env: dict | None = None, cwd: Path = REPO,
                 timeout: float = 120.0, paths: Iterable[str] = ("/health",), **popen) -> subprocess.Popen:  # fmt: skip
    """Start `cmd` (a server that listens on 127.0.0.1:`port`) and return it once it is healthy; it is killed if
    it does not come up. Its output goes to `log` when given (else as `popen` says: stdout=..., stderr=...)."""
    if log is not None:
        popen |= {"stdout": log.open("w"), "stderr": subprocess.STDOUT}
    proc = subprocess.Popen(cmd, cwd=cwd, env=server_env(env), **popen)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout, paths, what=Path(cmd[0]).name, log=log)
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc


def drain(engine, on_output: Callable | None = None) -> int:
    """Step `engine` until it has no unfinished request; every RequestOutput goes to `on_output`. Returns the
    number of steps."""
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if on_output is not None:
            for out in outputs:
                on_output(out)
    return steps


def finished_tokens(engine) -> dict[str, list[int]]:
    """Step `engine` until its requests are done; the token ids of each, by request id."""
    tokens: dict[str, list[int]] = {}

    def keep(out) -> None:
        if out.finished:
            tokens[out.request_id] = out.token_ids

    drain(engine, keep)
    return tokens


def median_seconds(fn: Callable[[], object], calls: int, warmup: int) -> float:
    """The median wall time of `calls` calls of `fn`, after `warmup` untimed ones (a kernel's micro-benchmark)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of an ascending list, interpolating linearly between the two nearest
    ranks like numpy.percentile's default: p50 of [1, 2, 3, 4] is 2.5. NaN for an empty list."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def write_json(path: Path, record: dict) -> None:
    """A benchmark's record as indented JSON, its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


def git(*args: str, cwd: Path = REPO, check: bool = True) -> str:
    """`git ARGS` in `cwd`, its stdout; CalledProcessError (with git's message) when it fails and `check`."""
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check).stdout


def git_version(repo: Path = REPO, paths: tuple[str, ...] = ("roseinfer",)) -> str:
    """The checkout's commit, `+dirty` when `paths` have uncommitted changes ("unknown" without git)."""
    try:
        rev = git("rev-parse", "--short=12", "HEAD", cwd=repo, check=False).strip()
        dirty = git("status", "--porcelain", "--", *paths, cwd=repo, check=False).strip()
    except OSError:
        return "unknown"
    return f"{rev}{'+dirty' if dirty else ''}"
