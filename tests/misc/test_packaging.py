"""pyproject.toml says its licence as setuptools reads it without a deprecation warning at every install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.skipif(not PYPROJECT.exists(), reason="needs the source tree's pyproject.toml")
def test_the_license_is_an_spdx_expression_setuptools_reads() -> None:
    config = tomllib.loads(PYPROJECT.read_text())
    assert config["project"]["license"] == "Apache-2.0"  # a TOML table ({text = ...}) is deprecated (PEP 639)
    (setuptools,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert floor is not None and int(floor.group(1)) >= 77, setuptools  # the first setuptools that reads an SPDX string
