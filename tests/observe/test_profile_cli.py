"""``stoker profile -- python script.py``: the README's quickstart, unchanged, gets a report, a trace and a plot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def quickstart() -> str:
    """The README's quickstart code, as a user would paste it into train.py."""
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None
    return match.group(1)


def profile(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(script)
    return subprocess.run(
        [sys.executable, "-m", "stoker", "profile", "--out", "prof", "--", "python", "train.py", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@pytest.mark.slow
def test_profile_the_readme_quickstart(tmp_path: Path) -> None:
    proc = profile(tmp_path, quickstart())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 2: loss" in proc.stdout  # the script ran as itself
    out = tmp_path / "prof"
    report = (out / "report.txt").read_text()
    assert "Loader('table.stoker', batch_size=1024)" in report and "verdict: " in report and "suggestion: " in report
    assert report.strip() in proc.stderr  # printed at exit too
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert sum(e["name"].startswith("batch ") for e in events) >= 3 * 10 - 1  # three epochs of 10 batches (the first apart)
    assert (out / "steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("tail", "status"), [("raise RuntimeError('boom')", 1), ("sys.exit(3)", 3), ("sys.exit(0)", 0)])
def test_the_scripts_exit_status_is_kept(tmp_path: Path, tail: str, status: int) -> None:
    script = (
        "import sys\nfrom stoker.flow import PipelineBuilder\nprint(list(PipelineBuilder().add_source(range(3)).pipe(str).add_sink(1).build()))\n"
        + tail
    )
    proc = profile(tmp_path, script, "--flag")
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "['0', '1', '2']" in proc.stdout
    assert "flow(source -> str)" in proc.stderr  # the report comes even when the script fails
    if status == 1:
        assert "RuntimeError: boom" in proc.stderr
    events = json.loads((tmp_path / "prof" / "trace.json").read_text())["traceEvents"]  # complete, however the script ended
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "flow(source -> str): the loop (waits, steps, Python stages)" in tracks
    assert sum(e["name"] == "str" for e in events) == 3  # each call of the stage


def test_no_script_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stoker", "profile", "--"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "needs a script" in proc.stderr


def test_the_help_says_the_plot_needs_matplotlib(capsys: pytest.CaptureFixture[str]) -> None:
    """``steps.png`` is written only with matplotlib, which stoker does not require: the help says so."""
    from stoker.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["profile", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "steps.png" in text and "matplotlib" in text


def profile_command(tmp_path: Path, *command: str, out: str = "prof") -> subprocess.CompletedProcess[str]:
    """``stoker profile --out OUT -- COMMAND`` run in ``tmp_path``."""
    return subprocess.run(
        [sys.executable, "-m", "stoker", "profile", "--out", out, "--", *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def refused(tmp_path: Path, *command: str, out: str = "prof") -> str:
    """The one-line error of ``stoker profile --out OUT -- COMMAND``, which must refuse it before anything runs."""
    proc = profile_command(tmp_path, *command, out=out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == "" and proc.stderr.startswith("stoker profile: ") and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert not (tmp_path / "ran").exists() and not (tmp_path / "prof").exists()  # refused before the script ran
    return proc.stderr


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            ["python", "-u", "train.py"],
            "the python option -u is not supported (only -m is): give it to the Python that runs stoker: python -u -m",
        ),
        (["python", "-X", "dev", "train.py"], "the python option -X dev is not supported (only -m is)"),
        (["python", "-c", "print(1)"], "the python option -c is not supported (only -m is): put the code in a file"),
        (["python", "trian.py"], "trian.py does not exist; give a Python script: python train.py [args] or python -m module [args]"),
        (["nonexistentcmd"], "nonexistentcmd does not exist"),
        (["/usr/bin/env", "python", "train.py"], "/usr/bin/env is a binary file, not a Python script"),
        (["python", "binary.py"], "binary.py is a binary file, not a Python script"),
        (["python", "run.sh"], "run.sh is not a Python script (not a .py file, nor Python source: invalid syntax"),
        (["python", "-m", "trian"], "no module named trian (looked in the current folder, then sys.path)"),
        (["python", "-m", "trian.sub"], "no module named trian (looked in the current folder, then sys.path)"),
        (["python", "-m", "train-v2"], "'train-v2' is not a module name"),
        (["python", "tools"], "tools has no __main__.py to run"),
    ],
    ids=["-u", "-X", "-c", "missing", "no-command", "env", "binary", "shell", "no-module", "no-package", "module-name", "no-main"],
)
def test_a_command_that_is_no_python_script_is_refused_in_one_line(tmp_path: Path, command: list[str], message: str) -> None:
    """An interpreter option, a mistyped script, a program or a shell script: one line naming it, and nothing runs."""
    if command[0] == "/usr/bin/env" and not Path(command[0]).is_file():
        pytest.skip("no /usr/bin/env here")
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    (tmp_path / "binary.py").write_bytes(b"open('ran', 'w').close()\n\0\x7fELF")
    (tmp_path / "run.sh").write_text("touch ran\necho ran\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "helpers.py").write_text("open('ran', 'w').close()\n")
    assert message in refused(tmp_path, *command)


def test_a_module_of_the_current_folder_runs_as_python_m_runs_it(tmp_path: Path) -> None:
    """``stoker profile -- python -m train`` from the ``stoker`` command (whose ``sys.path[0]`` is its own folder)
    finds ``train.py`` in the current folder, as ``python -m train`` does; so does a folder with a ``__main__.py``."""
    command = Path(sys.executable).with_name("stoker")
    if not command.is_file():
        pytest.skip("no stoker command beside this Python")
    (tmp_path / "train.py").write_text("import sys\nopen('ran', 'w').write(' '.join([__name__, *sys.argv[1:]]))\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("open('app-ran', 'w').close()\n")
    for args, made in ((["-m", "train", "--flag"], "ran"), (["app"], "app-ran")):
        proc = subprocess.run([str(command), "profile", "--out", "prof", "--", "python", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (tmp_path / made).exists()
    assert (tmp_path / "ran").read_text() == "__main__ --flag"


def test_python_source_without_py_runs(tmp_path: Path) -> None:
    """``python3.12 train`` (Python source, no ``.py``) runs as python would run it."""
    (tmp_path / "train").write_text("print('ran as', __name__)\n")
    proc = profile_command(tmp_path, "python3.12", "train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "ran as __main__\n"


def test_an_out_that_is_a_file_is_refused_before_the_script_runs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    (tmp_path / "notes.txt").write_text("kept\n")
    assert refused(tmp_path, "python", "train.py", out="notes.txt") == "stoker profile: notes.txt is not a folder\n"
    assert (tmp_path / "notes.txt").read_text() == "kept\n"
