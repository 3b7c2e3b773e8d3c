"""GPU kernels (Triton): one op family per module, plain-PyTorch references in ref_*.py."""
