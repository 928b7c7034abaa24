"""``scripts/mutants.py`` stays able to break what it claims to: each mutant's text is found exactly
once in its file, so a refactor that moves or rewrites the code it targets fails here instead of
turning the mutant into a silent "not applicable"."""

import importlib.util
import sys

import pytest

from tests.conftest import REPO


def _mutants() -> list[tuple[str, str, str, str]]:
    spec = importlib.util.spec_from_file_location("tpcache_mutants", REPO / "scripts" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tpcache_mutants", module)
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = _mutants()


@pytest.mark.parametrize("index", range(len(MUTANTS)), ids=[m[0] for m in MUTANTS])
def test_each_mutant_finds_its_text_exactly_once(index: int) -> None:
    what, path, old, new = MUTANTS[index]
    source = (REPO / path).read_text()
    assert source.count(old) == 1, f"mutant {index} ({what}): its text is in {path} {source.count(old)} times, not once"
    assert new != old
