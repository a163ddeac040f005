"""The offline benchmark (./benchmark.sh): `python scripts/benchmark.py --help`.

The harness is benchmarks/benchmark.py (workloads, engines in benchmarks/engine/bench_engines.py).
"""

import sys

from benchmarks.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
