"""The model's maths in plain PyTorch: the reference path that runs everywhere."""
