"""The library's docstring examples run as written: every ``>>>`` line of a module is a
doctest (the GPU-only illustrations are plain code blocks instead, so they are not)."""

import doctest
import importlib
import pkgutil
import re

import pytest

import agspec_gpu


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(agspec_gpu.__path__, "agspec_gpu."):
        spec = importlib.util.find_spec(info.name)
        if spec and spec.origin and spec.origin.endswith(".py") and \
                re.search(r"^\s*>>> ", open(spec.origin, encoding="utf-8").read(), re.M):
            names.append(info.name)
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    assert {"agspec_gpu.accept", "agspec_gpu.kv_cache", "agspec_gpu.tree"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
