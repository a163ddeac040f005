"""The project's C++ extension: every `roseinfer/csrc/*.cpp` built into one library of `torch.ops.roseinfer` ops.

Each source file registers its own ops with `TORCH_LIBRARY_FRAGMENT(roseinfer, m)` (the op's schema) and
`TORCH_LIBRARY_IMPL(roseinfer, CPU, m)` (its CPU code), so adding a kernel is adding a file: nothing here lists
them. The library is built the first time an op is needed, with the machine's compiler and `-march=native`
(the loops use whatever vector units this CPU has), and cached under ~/.cache/torch_extensions under a name
that carries a hash of the sources: a checkout of another stage builds its own library instead of loading
this one.

    import roseinfer.custom_ops as ops
    if ops.available():                        # built and loaded (or False, with a warning, once)
        torch.ops.roseinfer.paged_decode(...)  # the ops each csrc file registers

Where it cannot be built (no compiler, no ninja), `available()` is False and every caller falls back to its
PyTorch reference: the same results, more slowly.
"""

from __future__ import annotations

import functools
import hashlib
import time
import warnings
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# -fopenmp, not just -fopenmp-simd: at::parallel_for is a template in ATen's headers whose body is an
# `#pragma omp parallel` region, compiled into *this* library. Without -fopenmp the compiler drops the pragma
# and every at::parallel_for runs its whole range on the calling thread (stage 17's kernel did: one thread at
# any torch.set_num_threads). The library then needs libgomp.so.1, which resolves to the copy torch has
# already loaded, so there is one OpenMP runtime and one thread pool in the process.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# A build writes an object file every minute or two; a build folder where nothing moved for this long holds no
# build in progress.
STALE_LOCK_SECONDS = 600.0


def sources() -> list[Path]:
    """The extension's C++ files, in a fixed order."""
    return sorted(CSRC.glob("*.cpp"))


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove a build lock that no build holds any more; True when one was removed.

    torch builds under a lock file (`<build_dir>/lock`): the process that builds creates it and removes it when
    done, and every other process waits while it exists, with no time limit. A build killed half-way (a test's
    server stopped while it was starting, a Ctrl-C) leaves the lock behind, and from then on every process of
    this checkout waits forever at its first C++ op. A lock in a folder where nothing has been written for
    STALE_LOCK_SECONDS is such a leftover."""
    lock = build_dir / "lock"
    try:
        newest = max(p.stat().st_mtime for p in build_dir.iterdir())
    except (FileNotFoundError, ValueError):  # no folder yet, or an empty one
        return False
    age = (time.time() if now is None else now) - newest
    if not lock.exists() or age < STALE_LOCK_SECONDS:
        return False
    warnings.warn(f"removing {lock}: left by a build that stopped {age / 60:.0f} minutes ago", stacklevel=2)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def available() -> bool:
    """Build (first time) and load the library; False, with a warning, where it cannot be built."""
    files = sources()
    headers = sorted(CSRC.glob("*.h"))  # shared by several sources: a change to one rebuilds the library too
    code = b"".join(f.read_bytes() for f in files + headers)
    digest = hashlib.sha256(code + " ".join(CFLAGS).encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        clear_stale_lock(Path(_get_build_directory(f"roseinfer_ops_{digest}", verbose=False)))
        load(name=f"roseinfer_ops_{digest}", sources=[str(f) for f in files], extra_cflags=CFLAGS,
             is_python_module=False, verbose=False)  # fmt: skip
    except Exception as e:  # no compiler, no ninja, headers missing ...
        warnings.warn(f"roseinfer's C++ ops could not be built ({type(e).__name__}: {e}); the CPU paths fall "
                      f"back to their PyTorch references", stacklevel=2)  # fmt: skip
        return False
    return True
