"""The test-support package's docstring lists exactly the modules it holds."""

import re
from pathlib import Path

import pytest

import support

PACKAGE = Path(support.__file__).parent


@pytest.mark.quick
def test_the_package_docstring_names_every_module_and_no_other():
    listed = re.findall(r"^- ``([\w.]+)``:", support.__doc__, flags=re.MULTILINE)
    present = sorted(
        [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
        + [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    )
    assert sorted(listed) == present
