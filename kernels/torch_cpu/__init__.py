"""The torch backend: the production path on CPU (and a fallback anywhere torch runs).

    attention.py  paged attention, the K/V write and the page copy in plain torch, handing fp32
                  rows to the native CPU kernels (kernels/cpu/) where they apply
    windowed.py   a sliding layer's attention on the native kernels with their window
    backend.py    the backend object: plans a step once (kernels/attention_plan.py), binds the
                  native K/V writer at start-up, validates the layout once per step
    linear.py     the linear layers without a native kernel (oneDNN's blocked layout, F.linear,
                  the bf16 mode's), chosen at load by kernels/layer_ops.py
"""
