"""Project-wide pytest set-up."""

import os

import torch

import tests  # noqa: F401  (first: the repository root goes last on sys.path)

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
