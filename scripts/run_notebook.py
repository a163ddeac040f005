"""Execute a notebook in place of a person: `python scripts/run_notebook.py notebooks/kv_memory.ipynb`.

Runs every cell from the notebook's own folder (as Jupyter would), prints what the cells printed,
and fails on the first error. With ROSEINFER_SAVE_FIGURES=1 in the environment the notebooks also
write their chapter's figures. With --save the executed notebook, outputs and pictures included
(stderr left out), is written back to its file (that is how the committed notebooks got their
outputs):

    python scripts/run_notebook.py --save notebooks/*.ipynb
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

save = "--save" in sys.argv[1:]
for arg in [a for a in sys.argv[1:] if a != "--save"]:
    path = Path(arg).resolve()
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("name") == "stdout":
                print(out["text"], end="")
    if save:  # keep the file stable from run to run: no timings, no warnings from this machine
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs = [o for o in cell.outputs if o.get("name") != "stderr"]
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.write(nb, path)
    print(f"ran {path.name}" + (" (saved with its outputs)" if save else ""))
