"""Benchmarks (``python -m benchmarks.<name> --json``, from the repository root)."""

# the repository root last on sys.path, so that `import kernels` inside transformers finds the
# installed package, not this repository's kernels/ folder (see tests/__init__.py)
import tests  # noqa: F401
