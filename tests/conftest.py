"""Project-wide pytest set-up."""

import os

import torch

# Triton decides at decoration time whether kernels run in its CPU interpreter, so the switch
# must be set before `kernels` imports any Triton module; without a GPU the interpreter is
# the only way the Triton kernels run at all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Shared session fixtures: one loaded model and one live gateway for the whole run.
pytest_plugins = ["tests.model_fixtures", "tests.live_gateway"]
