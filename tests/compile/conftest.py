"""Every compile test starts from an empty Dynamo cache and empty counters, so frame and op counts are its own."""

import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
