"""Test set-up: Triton's interpreter on machines without CUDA, the `gpu` and `multigpu` markers and the shared
fixtures.

TRITON_INTERPRET must be set before any Triton kernel is defined, so it is set
here, before loraserve is imported by any test module.
"""
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs two CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


# -- shared fixtures: tiny random HF models (tests/model_fixtures.py builds them) ----------------

from model_fixtures import ARCHS, make_tiny_model, make_tokenizer  # noqa: E402 (after TRITON_INTERPRET)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tokenizer every tiny model is saved with (built once per session)."""
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tiny_tokenizer):
    """`factory(arch, **make_tiny_model keywords) -> folder`; each distinct request is built once."""
    built: dict[str, str] = {}

    def factory(arch: str, **options) -> str:
        key = json.dumps([arch, options], sort_keys=True, default=str)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(folder, arch, tokenizer=tiny_tokenizer, **options)
        return built[key]

    return factory


@pytest.fixture(params=ARCHS)
def tiny_model_dir(request, tiny_model_factory) -> str:
    """A tiny model folder, once per arch in ARCHS."""
    return tiny_model_factory(request.param)
