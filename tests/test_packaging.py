"""Each package's extra declares what its code imports, so `pip install corral[engine]` (what the
engine image runs) or `corral[bench]` gives a working command, not a ModuleNotFoundError that the
dev install (every extra at once) would hide."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The code each extra must carry (with the base dependencies).
EXTRA_CODE = {
    "engine": ["engine/corral_engine"],
    "gateway": ["gateway/corral_gateway"],
    "operator": ["operator/corral_operator"],
    "bench": ["cli/corral_cli/bench"],
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements(extra: str) -> set[str]:
    """Distribution names (normalized) the base dependencies and `extra` declare."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"][extra]
    return {_normalize(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in requirements}


def _imported_modules(code_dir: Path) -> dict[str, str]:
    """Top-level third-party modules imported anywhere under `code_dir`, with one file each."""
    found: dict[str, str] = {}
    for path in sorted(code_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not top.startswith("corral"):
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


# Modules that come with a declared distribution and are used only through it.
_PROVIDED_BY = {"starlette": "fastapi", "urllib3": "kubernetes"}


@pytest.mark.parametrize("extra", sorted(EXTRA_CODE))
def test_extras_declare_what_their_code_imports(extra: str) -> None:
    declared = declared_requirements(extra)
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for code_dir in EXTRA_CODE[extra]:
        for module, where in _imported_modules(ROOT / code_dir).items():
            names = {_normalize(d) for d in distributions.get(module, [module])}
            if not names & declared and _PROVIDED_BY.get(module) not in declared:
                missing.append(f"{module} ({where})")
    assert not missing, f"corral[{extra}] does not declare: {', '.join(missing)}"
