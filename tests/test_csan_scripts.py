"""The scripts test_cuda.py hands to a sanitized child interpreter parse and import on any
machine: a broken script would otherwise show only on a GPU, as a failure that is not a race."""
from __future__ import annotations

import ast
import importlib

import pytest

from _csan_scripts import CSAN_RACE, CSAN_SCENARIO

SCRIPTS = {"scenario": CSAN_SCENARIO, "race": CSAN_RACE}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_compiles(name):
    compile(SCRIPTS[name], f"<csan {name}>", "exec")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_imports_resolve(name):
    """Every module the script imports exists, with every name it takes from it (the script runs
    with tests/ and src/ on its path, as this test does)."""
    for node in ast.parse(SCRIPTS[name]).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"

