"""The Triton backend (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for the tests).

One ``@triton.jit`` kernel per file with its launcher: write_kv.py, copy_pages.py, decode.py
(+ decode_reduce.py, the flash-decoding merge), prefill.py; attention.py splits a mixed batch
between decode and prefill; common.py holds the shared device checks and dtype choices.
Imported only when kernels/dispatch.py first picks Triton, so ``triton`` stays optional.
"""
