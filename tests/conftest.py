import pytest
import torch

from gradkit._forward_ad import load_decompositions

# Tests call torch's own forward AD too (gradcheck(check_forward_ad=True), torch.func.jvp as an
# oracle), outside gradkit; load its decompositions once, as gradkit does, so torch's load-time
# deprecation warning does not depend on which test runs first.
load_decompositions()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
