"""Test set-up: Triton's interpreter on machines without CUDA, and the `gpu` marker.

TRITON_INTERPRET must be set before any Triton kernel is defined, so it is set
here, before loraserve is imported by any test module.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
