import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: one intra-op thread is fastest, and immune to the thread
    contention of a busy machine (which slows these tests down 5x with two threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
