import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one thread is fastest, and on a shared, busy CPU far faster than spinning two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
