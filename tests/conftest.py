"""Fixtures shared by the test modules."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """The test models are tiny: intra-op threads buy nothing, and on a small shared machine
    OpenMP threads spinning against the copy workers (and other processes) make steps 10x slower.
    A reference run and the engine's run share the setting, so bitwise comparisons hold. Use it
    per module with ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
