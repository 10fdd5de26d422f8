"""The longest functions of the source tree, by ``ast`` (the size rule of issue 28).

The rule: no function outside the CLI argument parsers and the kernels themselves is longer
than 60 lines. A function's length is its ``def`` line through its last line (decorators not
counted; a nested function counts inside its parent and again on its own). Excluded:

* CLI argument parsers: a function that calls ``add_argument`` at least
  ``PARSER_MIN_ADD_ARGUMENT`` times, or builds a parser (``ArgumentParser`` / ``add_parser``);
* kernels: a function decorated with ``triton.jit`` (or ``@jit``), i.e. the device code.

Run::

    python -m benchmarks.function_sizes                 # the 15 longest over the product code
    python -m benchmarks.function_sizes --top 30 --json out/function_sizes.json
    python -m benchmarks.function_sizes --check         # exit 1 if any is over --max-lines

It times nothing; it lives here beside the benchmarks because it measures the code, and
docs/benchmarks.md records its output.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("gateway", "engine", "cache", "kernels", "agents")
MAX_LINES = 60
PARSER_MIN_ADD_ARGUMENT = 3


@dataclass(frozen=True, slots=True)
class FunctionSize:
    path: str  # relative to the scanned root
    line: int  # the ``def`` line
    name: str  # qualified: Class.method, outer.inner
    lines: int


def _called_names(node: ast.AST) -> Iterator[str]:
    for child in ast.walk(node):
        if isinstance(child, ast.Call):
            func = child.func
            if isinstance(func, ast.Attribute):
                yield func.attr
            elif isinstance(func, ast.Name):
                yield func.id


def is_cli_parser(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Builds argparse flags: calls add_argument often, or creates a (sub)parser."""
    names = list(_called_names(node))
    return (
        names.count("add_argument") >= PARSER_MIN_ADD_ARGUMENT
        or "ArgumentParser" in names
        or "add_parser" in names
    )


def is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel: decorated ``@triton.jit`` / ``@jit`` (with or without arguments)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
        if isinstance(target, ast.Name) and target.id == "jit":
            return True
    return False


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def function_sizes(source: str, path: str) -> list[FunctionSize]:
    """Every function of one file that the rule covers (parsers and kernels left out)."""
    sizes = []
    for name, node in _functions(ast.parse(source, filename=path)):
        if is_cli_parser(node) or is_kernel(node):
            continue
        end = node.end_lineno or node.lineno
        sizes.append(FunctionSize(path, node.lineno, name, end - node.lineno + 1))
    return sizes


def scan(root: Path, dirs: Iterable[str] = PRODUCT_DIRS) -> list[FunctionSize]:
    """All covered functions under ``root/<dir>`` for each dir, longest first."""
    sizes: list[FunctionSize] = []
    for directory in dirs:
        for file in sorted((root / directory).rglob("*.py")):
            relative = file.relative_to(root).as_posix()
            sizes.extend(function_sizes(file.read_text(encoding="utf-8"), relative))
    return sorted(sizes, key=lambda s: (-s.lines, s.path, s.line))


def _table(sizes: list[FunctionSize], max_lines: int) -> str:
    rows = [f"{'lines':>5}  {'function':<48} where"]
    for size in sizes:
        flag = " *" if size.lines > max_lines else ""
        rows.append(f"{size.lines:>5}  {size.name:<48} {size.path}:{size.line}{flag}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="repository root")
    parser.add_argument("--dirs", nargs="+", default=list(PRODUCT_DIRS), help="folders to scan")
    parser.add_argument("--top", type=int, default=15, help="how many to list (default 15)")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES, help="the rule's limit")
    parser.add_argument("--json", type=Path, help="also write the list and the counts here")
    parser.add_argument("--check", action="store_true", help="exit 1 if any function is over")
    args = parser.parse_args(argv)
    sizes = scan(args.root, args.dirs)
    over = [s for s in sizes if s.lines > args.max_lines]
    print(_table(sizes[: args.top], args.max_lines))
    print(f"{len(sizes)} functions; {len(over)} over {args.max_lines} lines (* above)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "max_lines": args.max_lines,
            "functions": len(sizes),
            "over": [asdict(s) for s in over],
            "top": [asdict(s) for s in sizes[: args.top]],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
