"""The cache layer imports nothing above it (docs/design.md, layers): stdlib, xxhash and
itself only. The engine's sequence record reaches it through cache.sequence.CacheSequence."""

import ast
import sys
from pathlib import Path

import prefixgate.cache

CACHE_DIR = Path(prefixgate.cache.__file__).parent
ALLOWED_THIRD_PARTY = {"xxhash"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_cache_imports_only_stdlib_xxhash_and_itself():
    bad = {}
    for path in sorted(CACHE_DIR.glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY or top == "__future__":
                continue
            if name == "prefixgate.cache" or name.startswith("prefixgate.cache."):
                continue
            bad.setdefault(path.name, []).append(name)
    assert not bad, f"cache/ imports above its layer: {bad}"
