"""The README's code runs as written: every ```python block on its own, as a new user would paste it.

The blocks are read from README.md (never copied here); each runs in a fresh
Python process in an empty folder of its own, on the CPU, so a block that
needs a name or a file from another block fails. A block whose first line is
``# readme: skip`` (followed by the reason) is not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SKIP = "# readme: skip"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    """The README's ```python blocks, in order, those marked ``# readme: skip`` left out."""
    return [code for code in FENCE.findall(text) if not code.lstrip().startswith(SKIP)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_a_quickstart_that_trains() -> None:
    assert len(BLOCKS) >= 2, "the quickstart (write, train) and the image example"
    code = "\n".join(BLOCKS)
    for words in ("DatasetWriter(", "Loader(", "F.cross_entropy(", "loss.backward()", "optimizer.step()", "torch.cuda.is_available()"):
        assert words in code, f"the README's code lacks {words}"


@pytest.mark.parametrize("k", range(len(BLOCKS)), ids=[f"block{k + 1}" for k in range(len(BLOCKS))])
def test_each_readme_block_runs_pasted_alone(k: int, tmp_path: Path) -> None:
    code = BLOCKS[k]
    driver = f"exec(compile({code!r}, 'README.md python block {k + 1}', 'exec'), {{'__name__': '__main__'}})\nprint('README OK')"
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "README OK" in proc.stdout, (
        f"README python block {k + 1} fails when pasted alone:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    for name in re.findall(r"DatasetWriter\(\s*\"([^\"]+)\"", code):
        assert (tmp_path / name).exists(), f"block {k + 1} does not write {name}"
    if "loader.report()" in code:
        check_report_advice(proc.stdout, f"block {k + 1}")
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", proc.stdout)]
    if len(losses) >= 3:
        assert losses[-1] < losses[0], f"block {k + 1}: the loss does not fall: {losses}"


def check_report_advice(stdout: str, where: str) -> None:
    """A README example's printed ``report()`` gives advice that fits the example (tests/observe/test_advice.py tests it case by case).

    Its suggestion never asks to make one of stoker's own operations "a compiled operation" (they are compiled where
    they can be), and never to move one of the example's own operations before ``ToTensor`` (the example would be
    the one to fix).
    """
    from stoker import transforms
    from stoker.decoders import arrays as decoders

    ours = set(transforms.__all__) | set(decoders.__all__)
    lines = [line for line in stdout.splitlines() if line.startswith("suggestion: ")]
    assert lines, f"{where} prints loader.report(), but no suggestion line came out:\n{stdout[-3000:]}"
    for line in lines:
        named = re.match(r"suggestion: '[^':]+: ([\w+]+)'", line)
        if named and "make it a compiled operation" in line:
            assert not set(named.group(1).split("+")) & ours, f"{where}: report() advises making stoker's own operation compiled: {line}"
        assert "place it before ToTensor" not in line, f"{where}: its own pipeline is what report() advises to change: {line}"


def test_the_report_advice_check_catches_the_old_advice() -> None:
    old = "suggestion: 'image: NormalizeImage' runs as Python inside next(), on the loop's thread: make it a compiled operation (...)"
    with pytest.raises(AssertionError, match="stoker's own operation"):
        check_report_advice(old, "block 2")
    moved = "suggestion: 'image: NormalizeImage' runs after ToTensor, with torch on the loop's thread inside next(): place it before ToTensor, ..."
    with pytest.raises(AssertionError, match="its own pipeline"):
        check_report_advice(moved, "block 2")
    check_report_advice("suggestion: 'image: normalize' runs as Python inside next(): make it a compiled operation (...)", "block 2")
    check_report_advice("suggestion: none needed for the input: ...", "block 2")


def test_skip_marks_and_fences_are_understood() -> None:
    text = "a\n```python\nx = 1\n```\n```sh\nls\n```\n```python\n# readme: skip needs a GPU cluster\ny = 2\n```\n```python\nz = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n", "z = 3\n"]
