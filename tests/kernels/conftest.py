"""Kernel tests: triton runs for real on CUDA, under the interpreter (TRITON_INTERPRET=1) on CPU.

The interpreter switch must be in the environment before triton is first imported, hence at conftest import time.
"""

import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CELLIMAGE = pathlib.Path(__file__).resolve().parents[2] / "cellimage"
if str(_CELLIMAGE) not in sys.path:  # so `pytest tests/kernels` works without PYTHONPATH=cellimage
    sys.path.insert(0, str(_CELLIMAGE))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the triton cases run: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
