"""The test-support package's docstring lists exactly the modules it holds."""

import re
from pathlib import Path

import pytest

import sglang_dsa_mtp.testing as testing

PACKAGE = Path(testing.__file__).parent


@pytest.mark.quick
def test_the_package_docstring_names_every_module_and_no_other():
    listed = re.findall(r"^- ``(\w+)``:", testing.__doc__, flags=re.MULTILINE)
    present = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert sorted(listed) == present
