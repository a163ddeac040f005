"""Check the chapters against their stages: `python scripts/check_chapters.py --help`.

The implementation, and its rules, are in tools/chapters/ (check.py and one module per rule).
"""

import sys

from tools.chapters.check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
