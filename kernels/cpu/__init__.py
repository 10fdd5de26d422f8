"""The native CPU backend: C kernels (kernels/cpu/csrc/*.c) built into one shared object on
first use and called through ctypes, plus the CPU-only memory they read (huge pages).

    library.py      builds and loads the library (per machine, ``-march=native``)
    decode.py       paged decode attention (csrc/paged_decode.c)
    prefill.py      paged prefill attention (csrc/paged_prefill.c)
    cascade.py      the shared run of cascade (shared-prefix) decode, merged with each
                    member's own pages (csrc/paged_cascade.c)
    attention_inputs.py  the dtype, head-layout and overlap checks the three share
    ops.py          fused per-token layer ops and the linear layers (csrc/cpu_ops.c, linear.c,
                    linear_quant.c)
    host_memory.py  CPU tensors in transparent huge pages (the KV pool, packed weights)

Every entry point declines (returns False) what it does not handle, and the torch backend
(kernels/torch_cpu/attention.py) runs instead; nothing here is chosen by the dispatch directly.
"""
