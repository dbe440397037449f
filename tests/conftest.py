import os

# NOTE: must be set before any Triton kernel is defined; mrv2.platform does the same.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pathlib

import pytest
import torch

# ../shared/data beside the checkout, or MRV2_SHARED_DATA (e.g. a copy carried to the GPU machine).
SHARED_DATA = pathlib.Path(os.environ.get(
    "MRV2_SHARED_DATA", pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"))

# NOTE: tiny ops on 2 busy cores run several times faster on one thread.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shared_data():
    """../shared/data, or skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA
