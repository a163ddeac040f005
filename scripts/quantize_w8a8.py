"""Write a compressed-tensors int8 copy (W8A8 or W8A16) of a Llama-family or GPT-2 checkpoint:
`python scripts/quantize_w8a8.py --help`.

The implementation is tools/models/quantize_w8a8.py.
"""

import sys

from tools.models.quantize_w8a8 import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
