"""The quickstart notebook runs top to bottom (in a fresh kernel, its own 4 simulated
CPU devices) and ends with a finite loss curve."""

import math
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

import cli_runs

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes(monkeypatch):
  nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
  # The kernel sets its own device count and keeps the suite's other XLA flags: its
  # compile takes most of its time.
  monkeypatch.setenv("XLA_FLAGS", cli_runs.xla_flags_for_children())
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={
      "metadata": {
          "path": str(ROOT)
      }
  }).execute()
  text = "\n".join(
      o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "residual_mix" in text and "FAIL" not in text
  losses = [float(x) for x in re.findall(r"'(\d+\.\d{4})'", text)]
  assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
  assert any(
      o.get("output_type") == "display_data"
      for c in nb.cells
      for o in c.get("outputs", []))  # the plot
