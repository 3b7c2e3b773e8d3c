"""GPU kernels (Triton): one op family per module; their plain-PyTorch references are the
model's (lily/model, in the checks' form lily/model/ref.py)."""
