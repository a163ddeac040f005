"""Stage 20, the runtime around the kernels: the extension's threads and the allocator the benchmark runs on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roseinfer import custom_ops
from roseinfer.entrypoints import allocator


def test_the_benchmark_restarts_itself_on_the_allocator(monkeypatch):
    monkeypatch.delenv(allocator.MARK, raising=False)
    monkeypatch.setattr(allocator, "find_allocator", lambda choice: ("tcmalloc", "libtcmalloc_minimal.so.4"))
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))

    monkeypatch.setattr(allocator.os, "execve", execve)
    allocator.restart_with_allocator(["--threads", "2"], "auto", program=["scripts/benchmark.py"])
    (path, argv, env), *_ = calls
    assert argv[1:] == ["scripts/benchmark.py", "--threads", "2"]
    assert env["LD_PRELOAD"].startswith("libtcmalloc_minimal.so.4") and env[allocator.MARK] == "tcmalloc"
    assert env[allocator.HUGE_PAGES] == "1"  # PyTorch's huge pages switch, set for the second start
    calls.clear()
    monkeypatch.setenv(allocator.HUGE_PAGES, "0")  # a value of yours is kept
    allocator.restart_with_allocator([], "auto", program=["scripts/benchmark.py"])
    assert calls[0][2][allocator.HUGE_PAGES] == "0"


def thp_mode() -> str:
    """The kernel's transparent huge pages setting: the bracketed word of `always [madvise] never`."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "unknown"


@pytest.mark.skipif(thp_mode() != "madvise", reason="needs transparent huge pages in `madvise` mode")
@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_huge_pages_switch_puts_a_large_tensor_on_2_mib_pages(switch):
    """With THP_MEM_ALLOC_ENABLE=1 torch asks for huge pages under a 64 MiB tensor (the process's
    AnonHugePages grows); without it, in `madvise` mode, it gets none."""
    code = (
        "import torch, re\n"
        "x = torch.ones(16 << 20)\n"  # 64 MiB, written: its pages are faulted in
        "kb = sum(int(n) for n in re.findall(r'AnonHugePages:\\s+(\\d+)', open('/proc/self/smaps').read()))\n"
        "print(kb)\n"
    )
    env = {**os.environ, allocator.HUGE_PAGES: switch}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    huge_kib = int(out.split()[-1])
    assert (huge_kib >= 32 << 10) if switch == "1" else (huge_kib == 0), huge_kib


@pytest.mark.skipif(not custom_ops.available(), reason="the C++ extension cannot be built here")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two threads")
def test_the_extension_runs_on_torchs_threads():
    """at::parallel_for inside the extension uses torch's OpenMP pool: compiled without -fopenmp it ran every
    range on the calling thread. The op reports how many threads took part."""
    torch.set_num_threads(2)
    assert int(torch.ops.roseinfer.parallel_threads(64)) == 2
    torch.set_num_threads(1)
    try:
        assert int(torch.ops.roseinfer.parallel_threads(64)) == 1
    finally:
        torch.set_num_threads(2)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    """A build killed half-way leaves torch's lock file; every later process would wait on it forever."""
    build = tmp_path / "roseinfer_ops_0123456789ab"
    assert not custom_ops.clear_stale_lock(build)  # no folder yet
    build.mkdir()
    (build / "build.ninja").write_text("")
    (build / "lock").write_text("")
    newest = max(p.stat().st_mtime for p in build.iterdir())
    assert not custom_ops.clear_stale_lock(build, now=newest + 60)  # a build writing files: its lock stays
    assert (build / "lock").exists()
    with pytest.warns(UserWarning, match="left by a build that stopped"):
        assert custom_ops.clear_stale_lock(build, now=newest + custom_ops.STALE_LOCK_SECONDS + 1)
    assert not (build / "lock").exists() and (build / "build.ninja").exists()
    assert not custom_ops.clear_stale_lock(build, now=newest + 10 * custom_ops.STALE_LOCK_SECONDS)  # no lock
