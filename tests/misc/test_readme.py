"""The README's code runs as written: every ```python block, in order, in one namespace.

The blocks are read from README.md (never copied here) and run in a fresh
Python process in an empty folder, as a new user would paste them. A block
whose first line is ``# readme: skip`` (followed by the reason) is not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SKIP = "# readme: skip"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    """The README's ```python blocks, in order, those marked ``# readme: skip`` left out."""
    return [code for code in FENCE.findall(text) if not code.lstrip().startswith(SKIP)]


def test_the_readme_has_a_quickstart_that_trains() -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3, "the quickstart (write, train) and the image example"
    code = "\n".join(blocks)
    for words in ("DatasetWriter(", "Loader(", "F.cross_entropy(", "loss.backward()", "optimizer.step()", "torch.cuda.is_available()"):
        assert words in code, f"the README's code lacks {words}"


def test_the_readme_runs_as_written(tmp_path: Path) -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    # one script, each block in order, every block's line numbers kept for tracebacks (compile per block)
    driver = "\n".join(
        [
            "import sys",
            "namespace = {'__name__': '__main__'}",
            *(f"exec(compile({code!r}, 'README.md python block {k + 1}', 'exec'), namespace)" for k, code in enumerate(blocks)),
            "print('README OK')",
        ]
    )
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning"}
    proc = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "README OK" in proc.stdout, f"the README's code failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 5, proc.stdout  # 3 epochs of the table, 2 of the images
    assert losses[2] < losses[0], f"the table's loss does not fall: {losses[:3]}"
    assert (tmp_path / "table.stoker").exists() and (tmp_path / "images.stoker").exists()


def test_skip_marks_and_fences_are_understood() -> None:
    text = "a\n```python\nx = 1\n```\n```sh\nls\n```\n```python\n# readme: skip needs a GPU cluster\ny = 2\n```\n```python\nz = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n", "z = 3\n"]
