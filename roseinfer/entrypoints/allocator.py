"""A memory allocator that gives memory back, for a server that runs for days (`roseinfer serve --allocator`).

A step allocates tensors whose sizes follow the batch: a few rows now, a few hundred the next step. glibc's
malloc serves mid-sized blocks from heaps ("arenas") that it cannot shrink while one live block sits near the
top, so under a steady load a server's resident memory creeps up. tcmalloc and jemalloc keep size classes apart
and return whole pages to the system. vLLM's CPU build asks its users to preload tcmalloc for this reason.

A library replaces malloc only if it is loaded before anything else: the server starts itself again with
`LD_PRELOAD` naming it, once, before it loads the model:

    roseinfer serve                        glibc ──► execve(python -m roseinfer serve ..., LD_PRELOAD=tcmalloc)
                                                     ROSEINFER_ALLOCATOR=tcmalloc marks the second start

It matters for speed too, not only for memory: a step's activations are fresh tensors of up to tens of
megabytes, and glibc hands large ones back to the system on free and maps them again, page by page, at
the next step (chapter 20 measures the difference). scripts/benchmark.py restarts itself the same way
(`--allocator`), so roseinfer runs there as the server runs, and as vLLM's CPU build runs beside it.

`--allocator auto` (the default) takes tcmalloc, else jemalloc, when the system has it (Debian's packages
`libtcmalloc-minimal4`, `libjemalloc2`; scripts/setup.sh installs the first where it can), else stays on
glibc's malloc; `--allocator system` never restarts.

The restart also sets PyTorch's own switch for huge pages, `THP_MEM_ALLOC_ENABLE=1` (unless you set it): every
CPU buffer of 2 MiB or more is then asked of the kernel in 2 MiB pages (`madvise(MADV_HUGEPAGE)`, where
/sys/kernel/mm/transparent_hugepage/enabled says `madvise` or `always`). A decode step reads all the weights
and, for each sequence, blocks scattered over a KV pool of gigabytes; in 4 KiB pages nearly every block and
every few dozen rows of a weight is a page the CPU must look up again (a TLB miss), in 2 MiB pages one lookup
covers 512 times as much. PyTorch reads the variable once, at its first allocation, so it too takes a restart.
Chapter 22's section 9.8 measures it (its long form, and chapter 20's, have every run).
"""

from __future__ import annotations

import ctypes.util
import os
import sys

ALLOCATORS = {"tcmalloc": "tcmalloc_minimal", "jemalloc": "jemalloc"}  # name -> library, as find_library names it
CHOICES = ("auto", *ALLOCATORS, "system")
MARK = "ROSEINFER_ALLOCATOR"  # set in the restarted process: which allocator it runs on
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # PyTorch's (c10's) switch for 2 MiB pages under large CPU buffers


def find_allocator(choice: str = "auto") -> tuple[str, str] | None:
    """(name, library file) of the allocator to preload, or None for glibc's malloc."""
    if choice not in CHOICES:
        raise ValueError(f"unknown allocator {choice!r}; use one of {CHOICES}")
    names = list(ALLOCATORS) if choice == "auto" else [choice] if choice in ALLOCATORS else []
    for name in names:
        library = ctypes.util.find_library(ALLOCATORS[name])  # e.g. libtcmalloc_minimal.so.4, or None
        if library is not None:
            return name, library
        if choice != "auto":
            raise SystemExit(f"--allocator {choice}: the library {ALLOCATORS[name]} is not installed")
    return None


def restart_with_allocator(argv: list[str], choice: str = "auto", program: list[str] | None = None) -> None:
    """Start this command again with the allocator preloaded (does not return), unless this process is that
    second start already, or there is nothing to preload. `program`: what runs `argv` (default `python -m
    roseinfer`; scripts/benchmark.py passes its own path)."""
    if os.environ.get(MARK) is not None:
        return
    found = find_allocator(choice)
    if found is None:
        return
    name, library = found
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    env = {HUGE_PAGES: "1", **os.environ, "LD_PRELOAD": preload, MARK: name}  # yours wins for HUGE_PAGES
    sys.stdout.flush()
    program = program or ["-m", "roseinfer"]
    os.execve(sys.executable, [sys.executable, *program, *argv], env)
