"""examples/notebook.ipynb, executed by a real Jupyter kernel against a real stack (API, scheduler, Ray), its cells'
outputs checked: the quick start of docs/client.md runs as written."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from service.stack.embedded import Stack

pytestmark = pytest.mark.slow
NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"


def text_of(cell: nbformat.NotebookNode) -> str:
    """What a code cell showed: its printed text and its results' plain text."""
    out = []
    for o in cell.get("outputs", []):
        assert o["output_type"] != "error", "".join(o.get("traceback", []))
        out.append(o.get("text", "") if o["output_type"] == "stream" else o.get("data", {}).get("text/plain", ""))
    return "".join(out)


def test_the_notebook_runs_against_a_real_stack(stack: Stack, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLAB_URL", stack.url)
    monkeypatch.setenv("TLAB_TOKEN", stack.admin_token)
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's own paths, without its deprecation warning
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = [text_of(c) for c in nb.cells if c.cell_type == "code"]
    signed_in, first, result, compared, figure, trials, more, tensorboard, refused = shown

    assert signed_in.strip() == "signed in as admin"
    assert [line.split(":")[0] for line in first.splitlines()] == [f"epoch {e}" for e in range(4)]
    assert result.startswith("succeeded - final test loss") and "test_acc" in result
    assert "first" in compared and "plain" in compared and compared.count("succeeded") == 2
    assert "train loss" in figure.lower() or "loss" in figure.lower()
    assert trials.count("succeeded") == 2 and "teleport.enabled" in trials
    assert more.strip() == "succeeded epochs [0, 1, 2, 3, 4, 5]"
    assert tensorboard.startswith("5 runs:")  # two experiments, a sweep's root (its HParams view) and two trials
    assert refused.split()[0] == "422" and refused.split()[1].endswith("training.epochs")
    assert (tmp_path / "tensorboard").is_dir()
