"""Execute a notebook in place of a person: `python scripts/run_notebook.py notebooks/kv_memory.ipynb`.

Runs every cell from the notebook's own folder (as Jupyter would) and fails on the first error.
With ROSEINFER_SAVE_FIGURES=1 in the environment the notebooks also write their chapter's figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

for arg in sys.argv[1:]:
    path = Path(arg).resolve()
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("name") == "stdout":
                print(out["text"], end="")
    print(f"ran {path.name}")
