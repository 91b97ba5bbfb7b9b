"""The family registry (``mla_ops.models.families.FAMILIES``): a model type is read through its record alone, and
a record without its tests and its docs/models.md row is caught here, not by a user."""

import glob
import os
import re

import pytest

from mla_ops.models.config import MLAConfig
from mla_ops.models.families import FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_config_of_an_unknown_model_type_lists_every_family():
    with pytest.raises(ValueError, match="model_type 'llava' is not one mla_ops reads") as e:
        MLAConfig.from_hf({"model_type": "llava"})
    assert all(repr(name) in str(e.value) for name in FAMILIES)


def test_config_of_a_wrapper_type_as_its_own_text_model_is_refused():
    with pytest.raises(ValueError, match="model_type 'kimi_k25' is not one mla_ops reads"):
        MLAConfig.from_hf({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k25"}})


def test_every_family_has_tests_and_a_docs_row():
    tests = "".join(open(path).read() for path in glob.glob(os.path.join(ROOT, "tests", "models", "test_*.py"))
                    if not path.endswith("test_families.py"))
    table = [line for line in open(os.path.join(ROOT, "docs", "models.md")) if line.startswith("| `")]
    wrapped = {f.wrapper.text_model_type: name for name, f in FAMILIES.items() if f.wrapper is not None}
    for name in FAMILIES:
        # a wrapper's text model type is tested through its wrapper (transformers writes it there)
        assert re.search(rf"\b({name}|{wrapped.get(name, name)})\b", tests), f"no test in tests/models names {name}"
        assert any(f"`{name}`" in row for row in table), f"docs/models.md's table has no row for {name}"
