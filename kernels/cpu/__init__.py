"""The native CPU backend: C kernels (kernels/cpu/csrc/*.c) built into one shared object on
first use and called through ctypes, plus the CPU-only memory they read (huge pages).

    library.py      builds and loads the library (per machine, ``-march=native``)
    decode.py       paged decode attention (csrc/paged_decode.c)
    prefill.py      paged prefill attention (csrc/paged_prefill.c)
    cascade.py      the shared run of cascade (shared-prefix) decode, merged with each
                    member's own pages (csrc/paged_cascade.c)
    attention_inputs.py  the dtype, head-layout and overlap checks the three share
    ops.py          fused per-token layer ops (csrc/cpu_ops.c): RMSNorm, SiLU-and-multiply,
                    RoPE, the K/V scatter
    linear.py       the fp32 linear layer (csrc/linear.c) and the bound native linear op
    linear_bf16.py  the bf16 mode's linear layer (csrc/linear_bf16.c)
    linear_quant.py GGUF-block linear layers: weight-only (csrc/linear_quant.c, linear_amx.c)
                    and the q8 mode's int8 activations (csrc/linear_q8.c)
    host_memory.py  CPU tensors in transparent huge pages (the KV pool, packed weights)

Every one-off entry point declines (returns None / False) what it does not handle, and the
torch path runs instead. A model's layers do not call those: the kernel registry
(kernels/layer_ops.py) binds the ops here (``Native*`` classes) once, at load, where they apply.
"""
