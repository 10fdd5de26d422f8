"""The Triton backend (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for the tests).

One ``@triton.jit`` kernel per file with its launcher: write_kv.py, copy_pages.py, decode.py
(+ decode_reduce.py, the flash-decoding merge), prefill.py; attention.py splits a mixed batch
between decode and prefill; common.py holds the shared device checks and dtype choices.
backend.py is the backend object the registry (kernels/dispatch.py) creates; imported only
when Triton is first chosen, so ``triton`` stays optional.
"""
