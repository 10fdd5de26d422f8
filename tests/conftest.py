"""Project-wide pytest set-up."""

import os
import sys
from pathlib import Path

import torch

# The repository root is on sys.path only so that `tests.*` and `benchmarks.*` import; it goes
# LAST. Its folders gateway/, cache/, kernels/, agents/ are the prefixgate.* subpackages, and a
# bare `import agents` must find the OpenAI Agents SDK, never this repository's client folder
# (`python -m pytest` puts the working directory first; `--import-mode=append` in pyproject.toml
# covers pytest's own insertion).
_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO] + [str(_REPO)]

# Triton decides at decoration time whether kernels run in its CPU interpreter, so the switch
# must be set before `kernels` imports any Triton module; without a GPU the interpreter is
# the only way the Triton kernels run at all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs 2 workers) each worker gets its share of the cores for
# torch's and the native kernels' threads: two workers at 2 threads each on 2 cores would
# oversubscribe them, and OpenMP threads spin while they wait for each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# Shared session fixtures: one loaded model and one live gateway for the whole run.
pytest_plugins = ["tests.model_fixtures", "tests.live_gateway"]
