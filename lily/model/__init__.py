"""The model: its maths once in plain PyTorch (the reference that runs everywhere), the ops
that run it on the Triton kernels where asked (ops.py), and the decoder written once
(model.py)."""
