"""benchmarks/function_sizes.py: what it counts, what it leaves out, and its report."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from benchmarks.function_sizes import REPO, function_sizes, scan

SOURCE = textwrap.dedent(
    '''
    import argparse
    import triton


    def short():
        return 1


    class Engine:
        def step(self):
            x = 1

            def inner():
                return x

            return inner()


    def build(sub):
        p = sub.add_parser("serve")
        p.add_argument("--a")
        return p


    def flags(p):
        p.add_argument("--a")
        p.add_argument("--b")
        p.add_argument("--c")


    def two_flags(p):
        p.add_argument("--a")
        p.add_argument("--b")


    @triton.jit
    def kernel(x_ptr, BLOCK: tl.constexpr):
        pass


    @triton.jit(do_not_specialize=["n"])
    def kernel_with_args(x_ptr, n):
        pass
    '''
)


def test_counts_def_to_last_line_with_qualified_names_and_skips_parsers_and_kernels():
    sizes = {s.name: s for s in function_sizes(SOURCE, "mod.py")}
    assert set(sizes) == {"short", "Engine.step", "Engine.step.inner", "two_flags"}
    assert (sizes["short"].line, sizes["short"].lines) == (6, 2)
    assert (sizes["Engine.step"].line, sizes["Engine.step"].lines) == (11, 7)
    assert (sizes["Engine.step.inner"].line, sizes["Engine.step.inner"].lines) == (14, 2)
    assert sizes["two_flags"].path == "mod.py"


def test_report_on_the_repository(tmp_path):
    out = tmp_path / "sizes.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.function_sizes", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    top = report["top"]
    assert len(top) == 15 and report["max_lines"] == 60
    assert [row["lines"] for row in top] == sorted((row["lines"] for row in top), reverse=True)
    assert len(report["over"]) == sum(1 for s in scan(REPO) if s.lines > 60)
    for row in top:  # every file:line points at the function's def
        line = (REPO / row["path"]).read_text().splitlines()[row["line"] - 1]
        assert f"def {row['name'].rsplit('.', 1)[-1]}(" in line
        assert f"{row['path']}:{row['line']}" in result.stdout
    assert not any(row["path"].startswith("tests/") for row in top)


def test_the_size_rule_holds_on_the_repository():
    """Issue 28's rule, gated: none over 60 lines outside CLI parsers and Triton kernels, and
    the engine's step stays a few phases long."""
    sizes = scan(REPO)
    over = [f"{s.path}:{s.line} {s.name} ({s.lines} lines)" for s in sizes if s.lines > 60]
    assert not over, "functions over 60 lines (split them):\n" + "\n".join(over)
    (step,) = [s for s in sizes if s.name == "LLMEngine.step"]
    assert step.lines <= 25, f"LLMEngine.step is {step.lines} lines (at most 25: its phases)"
