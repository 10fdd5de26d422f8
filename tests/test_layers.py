"""The layer rules of docs/design.md ("Layers: an arrow may only point down"), one test per rule.

Every module under the four product folders is parsed with ``ast`` (nothing is imported), and
every import it makes is checked: at the top, inside functions and under ``TYPE_CHECKING``
alike, since each is a dependency. A failure names the file, the import and the rule.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("agents", "cache", "engine", "gateway", "kernels")
SURFACES = ("openai", "responses", "anthropic")  # gateway/server/<surface>/
SURFACE_PACKAGES = tuple(f"prefixgate.gateway.server.{name}" for name in SURFACES)


class Import(NamedTuple):
    path: str  # the importing file, relative to the repository root
    line: int
    module: str  # absolute, e.g. prefixgate.gateway.server.errors
    top_level: bool  # executed on import (not inside a function)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["prefixgate", *parts])


def _resolve(node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        yield child, in_function
        nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        yield from _walk(child, nested)


def _file_imports(path: Path) -> list[Import]:
    rel = path.relative_to(REPO).as_posix()
    found = []
    for node, in_function in _walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, path)
            # ``from package import submodule`` imports the submodule: keep both names
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.extend(Import(rel, node.lineno, name, not in_function) for name in names)
    return found


@cache
def all_imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for directory in PRODUCT_DIRS:
        for path in sorted((REPO / directory).rglob("*.py")):
            found.extend(_file_imports(path))
    return tuple(found)


def _top(module: str) -> str:
    return module.split(".")[0]


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _violations(
    folder: str, forbidden: Callable[[Import], bool], rule: str, exempt: tuple[str, ...] = ()
) -> list[str]:
    bad: dict[tuple[str, int], str] = {}  # one line per import statement
    for imp in all_imports():
        if imp.path.startswith(folder) and imp.path not in exempt and forbidden(imp):
            bad[imp.path, imp.line] = min(bad.get((imp.path, imp.line), imp.module), imp.module)
    return [f"{path}:{line} imports {module}  (rule: {rule})"
            for (path, line), module in sorted(bad.items())]


def _assert_none(violations: list[str]) -> None:
    assert not violations, "layer rule broken (docs/design.md, Layers):\n" + "\n".join(violations)


def _stdlib(module: str) -> bool:
    return _top(module) in sys.stdlib_module_names or module == "__future__"


def test_the_scan_sees_every_product_folder():
    """Guards the rules below against passing vacuously (a moved folder, a broken parser)."""
    counted = {imp.path.split("/")[0] for imp in all_imports()}
    assert counted == set(PRODUCT_DIRS)
    assert any(imp.module == "prefixgate.cache.manager" for imp in all_imports())


def test_agents_is_an_http_client_only():
    ours = ("prefixgate.gateway", "prefixgate.engine", "prefixgate.cache", "prefixgate.kernels")
    _assert_none(_violations(
        "agents/", lambda imp: _within(imp.module, *ours),
        "agents/ must not import gateway, engine, cache or kernels: it is a client, HTTP only"))


def test_server_router_and_scaleout_do_not_import_kernels():
    for folder in ("gateway/server/", "gateway/router/", "gateway/scaleout/"):
        _assert_none(_violations(
            folder, lambda imp: _within(imp.module, "prefixgate.kernels"),
            f"{folder} must not import kernels directly (the engine owns them)"))


def test_engine_imports_no_http_framework_redis_or_anything_above_it():
    above = ("prefixgate.gateway", "prefixgate.agents")
    _assert_none(_violations(
        "engine/",
        lambda imp: _top(imp.module) in {"fastapi", "starlette", "uvicorn", "redis"}
        or _within(imp.module, *above),
        "engine/ must not import fastapi (starlette, uvicorn), redis, or anything of "
        "gateway/ (server, router, scaleout, http, cli) or agents/ above it"))


def test_cache_imports_only_stdlib_xxhash_and_itself():
    _assert_none(_violations(
        "cache/",
        lambda imp: not (_stdlib(imp.module) or _top(imp.module) == "xxhash"
                         or _within(imp.module, "prefixgate.cache")),
        "cache/ may import xxhash and the stdlib only (no torch, fastapi, redis, nothing above)"))


def test_kernels_import_torch_triton_and_themselves_only():
    _assert_none(_violations(
        "kernels/",
        lambda imp: not (_stdlib(imp.module) or _top(imp.module) in {"torch", "triton"}
                         or _within(imp.module, "prefixgate.kernels")),
        "kernels/ may import torch, triton and the stdlib only, nothing of ours outside kernels/"))


# how the cache keeps its pages, queues, retention and state slots: only cache/ itself (the KV
# manager and what it is made of) imports these; everything above goes through the manager and
# the package's exported records (docs/design.md; issue 39, "one owner for the cache")
CACHE_INTERNALS = tuple(f"prefixgate.cache.{name}" for name in (
    "block_pool", "page", "free_queue", "retention", "state_slots", "manager", "sequence",
    "tier_pages", "integrity", "state_group", "prefix_lookup", "kept_prefixes", "copy_on_write"))


def test_only_the_kv_manager_touches_the_cache_internals():
    for folder in ("gateway/", "engine/", "agents/", "kernels/"):
        _assert_none(_violations(
            folder, lambda imp: _within(imp.module, *CACHE_INTERNALS),
            f"{folder} must not import cache/ internals (block pool, pages, free queue, "
            "retention, state slots, the manager module): use prefixgate.cache's exports"))


# the scheduler's KV side: the scheduler (its steps and its admission half), its connector (second-tier pages) and
# KVControl (pins, retention, stats, events, reset for the engine and the gateway); the build
# module only constructs the manager
KV_OWNERS = tuple(f"engine/{name}.py" for name in (
    "scheduler", "admission", "kv_connector", "kv_control"))
KV_BUILDERS = ("engine/build.py",)
# where ``.cache`` would mean the KV manager: the engine's own modules (its subpackages keep
# other caches: the grammar compiler's) and every gateway package above it
KV_CALLERS = ("engine/*.py", "gateway/server/**/*.py", "gateway/router/**/*.py",
              "gateway/scaleout/**/*.py")


def _other_cache(owner: ast.expr) -> bool:
    """``functools.cache``, and a grammar compiler's compile cache: not the KV manager."""
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return name == "functools" or "compiler" in name


def test_only_the_schedulers_kv_side_calls_the_cache():
    """Issue 39, "one owner for the cache": nothing in the engine or the gateway holds the KV
    manager but the scheduler's KV side; the engine and the server reach it through
    ``scheduler.kv`` (KVControl), never as ``<anything>.cache``."""
    bad = []
    for pattern in KV_CALLERS:
        for path in sorted(REPO.glob(pattern)):
            rel = path.relative_to(REPO).as_posix()
            if rel in KV_OWNERS:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "cache" and not _other_cache(node.value):
                    bad.append(f"{rel}:{node.lineno} reads .cache  (rule: only the scheduler's "
                               "KV side calls the KV manager; use scheduler.kv)")
                names = ([a.name for a in node.names] if isinstance(node, ast.ImportFrom)
                         and (node.module or "").startswith("prefixgate.cache") else [])
                if "KVCacheManager" in names and rel not in KV_BUILDERS:
                    bad.append(f"{rel}:{node.lineno} imports KVCacheManager  (rule: only the "
                               "scheduler's KV side and the build module hold the KV manager)")
    _assert_none(bad)


# the kernel backends' own folders: a model asks the kernel registry (kernels/layer_ops.py) or
# the dispatch (kernels/dispatch.py, the kernels package) for its ops, bound once at load, and
# never imports a backend (issue 39, "ops bound per layer at load")
KERNEL_BACKENDS = tuple(f"prefixgate.kernels.{name}" for name in ("cpu", "triton", "torch_cpu"))


def test_models_import_no_kernel_backend():
    _assert_none(_violations(
        "engine/models/", lambda imp: _within(imp.module, *KERNEL_BACKENDS),
        "engine/models must not import a kernel backend (kernels.cpu, kernels.triton, "
        "kernels.torch_cpu): bind ops through the registry (kernels.layer_ops) or the dispatch"))


def _module_file(module: str) -> Path | None:
    if not module.startswith("prefixgate."):
        return None
    relative = Path(*module.split(".")[1:])
    for candidate in (REPO / relative.with_suffix(".py"), REPO / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_scheduler_imports_no_torch_even_indirectly():
    """What ``import prefixgate.engine.scheduler`` runs: the scheduler, each of our
    modules it imports at module level, theirs, and the packages around them. Only the runner
    builds tensors."""
    by_file: dict[str, list[Import]] = {}
    for imp in all_imports():
        by_file.setdefault(imp.path, []).append(imp)
    chain = {"prefixgate.engine.scheduler": "the scheduler"}
    todo = list(chain)
    bad = []
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for parent in (".".join(parts[:i]) for i in range(2, len(parts))):
            if parent not in chain:
                chain[parent] = f"the package of {module}"
                todo.append(parent)
        path = _module_file(module)
        if path is None:
            continue
        for imp in by_file.get(path.relative_to(REPO).as_posix(), []):
            if not imp.top_level:
                continue
            if _top(imp.module) == "torch":
                bad.append(f"{imp.path}:{imp.line} imports {imp.module} (reached from "
                           f"{chain[module]})  (rule: the scheduler imports no torch)")
            elif (_within(imp.module, "prefixgate") and imp.module not in chain
                  and _module_file(imp.module) is not None):
                chain[imp.module] = module
                todo.append(imp.module)
    _assert_none(sorted(set(bad)))


def _surface_of(path: str) -> str | None:
    parts = path.split("/")
    if parts[:2] == ["gateway", "server"] and len(parts) > 3 and parts[2] in SURFACES:
        return parts[2]
    return None


def test_api_surfaces_do_not_import_each_other():
    def crosses(imp: Import) -> bool:
        own = _surface_of(imp.path)
        others = [p for p in SURFACE_PACKAGES if not p.endswith(f".{own}")]
        return own is not None and _within(imp.module, *others)

    _assert_none(_violations(
        "gateway/server/", crosses,
        "an API surface (gateway/server/<surface>/) must not import another surface"))


def test_the_shared_server_core_imports_no_surface():
    """The shared pipeline, tools, errors, cache and ops routes stay neutral; only the app
    factory, which wires every surface's router, names them."""
    _assert_none(_violations(
        "gateway/server/",
        lambda imp: _surface_of(imp.path) is None and _within(imp.module, *SURFACE_PACKAGES),
        "the shared core of gateway/server must not import an API surface (move what both "
        "need into a neutral module)",
        exempt=("gateway/server/app.py",)))


def test_a_rule_names_the_file_the_import_and_the_rule(monkeypatch):
    """The failure message is what a contributor reads: check its shape on a planted import."""
    planted = Import("cache/planted.py", 3, "torch", True)
    monkeypatch.setattr(sys.modules[__name__], "all_imports", lambda: (planted,))
    message = _violations("cache/", lambda imp: _top(imp.module) == "torch", "no torch in cache")
    assert message == ["cache/planted.py:3 imports torch  (rule: no torch in cache)"]


# what the router may take from gateway/server (issue 39): the surfaces' wire formats, parsed as
# a replica parses them, and what renders a prompt exactly as a replica does (tokenization,
# tools, the settings' format names). HTTP plumbing (auth, errors, request ids, limits, header
# names, metric labels, the bound uvicorn server) and what both serve (the dashboard page, the
# cache-stats JSON pieces) come from gateway/http, which both import; nothing else of a surface.
ROUTER_MAY_USE = (*(f"prefixgate.gateway.server.{name}.schemas" for name in SURFACES),
                  *(f"prefixgate.gateway.server.{name}" for name in (
                      "tokenization", "tools", "settings")))


def test_the_router_imports_no_server_internals():
    def internal(imp: Import) -> bool:
        # ``from prefixgate.gateway.server import dashboard`` names the package and the module
        if imp.module == "prefixgate.gateway.server":
            return False
        return (_within(imp.module, "prefixgate.gateway.server")
                and not _within(imp.module, *ROUTER_MAY_USE))

    _assert_none(_violations(
        "gateway/router/", internal,
        "gateway/router imports from gateway/server only the surfaces' schemas and the prompt "
        "rendering; shared HTTP pieces live in gateway/http"))


def test_the_shared_http_module_imports_no_server_or_router():
    _assert_none(_violations(
        "gateway/http/", lambda imp: _within(imp.module, "prefixgate.gateway.server",
                                             "prefixgate.gateway.router"),
        "gateway/http is shared by the server and the router: it imports neither"))
