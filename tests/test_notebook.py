"""The quickstart notebook runs top to bottom (in a fresh kernel, its own 4 simulated
CPU devices) and ends with a finite loss curve."""

import math
import os
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes():
  nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
  env_flags = os.environ.pop("XLA_FLAGS", None)  # the kernel sets its own device count
  try:
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
  finally:
    if env_flags is not None:
      os.environ["XLA_FLAGS"] = env_flags
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
  assert "residual_mix" in text and "FAIL" not in text
  losses = [float(x) for x in re.findall(r"'(\d+\.\d{4})'", text)]
  assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
  assert any(o.get("output_type") == "display_data" for c in nb.cells
             for o in c.get("outputs", []))  # the plot
