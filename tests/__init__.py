"""The test suite (run from the repository root).

The repository root is on sys.path only so that ``tests.*`` and ``benchmarks.*`` import; it
goes LAST, set here because this package is imported first both by pytest (``tests/conftest.py``)
and by ``python -m tests.<module>`` (``make fixtures``). Its folders gateway/, engine/, cache/,
kernels/, agents/ are the prefixgate.* subpackages, and a bare top-level import must find the
installed distribution of that name, never this repository's folder: ``import agents`` the
OpenAI Agents SDK, ``import kernels`` Hugging Face's kernels package (transformers imports it
when it is installed). ``python -m`` puts the working directory first; ``--import-mode=append``
in pyproject.toml covers pytest's own insertion.
"""

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO] + [str(_REPO)]
