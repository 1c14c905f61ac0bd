"""Test settings shared by every test: the seed, and the device the tests run on.

``GRADKIT_TEST_DEVICE`` (default ``cpu``; e.g. ``cuda`` or ``cuda:1``) picks the device. On a
device other than the CPU every test runs with it as torch's default device (tensors and
modules the test creates land there), tests marked ``cpu_only`` (subprocesses, gloo process
groups, the CLI, the benchmark harness) are skipped with that reason, and the ``device``
fixture gives it to tests that move things explicitly. On CUDA, TF32 is off in every test: the
tests compare float32 results with float64 references at float32 tolerances, and TF32 rounds
convolutions and matmuls (the forward pass included) to 1e-3 (``tests/per_example/test_cuda.py``
turns it on where it tests it). Tests marked ``cuda`` need CUDA and
are skipped, visibly, without it. Asking for CUDA where there is none is an error, never a
silent run on the CPU.
"""

import os

import pytest
import torch

from gradkit._forward_ad import load_decompositions

# Tests call torch's own forward AD too (gradcheck(check_forward_ad=True), torch.func.jvp as an
# oracle), outside gradkit; load its decompositions once, as gradkit does, so torch's load-time
# deprecation warning does not depend on which test runs first.
load_decompositions()

_VARIABLE = "GRADKIT_TEST_DEVICE"


def _test_device() -> torch.device:
    name = os.environ.get(_VARIABLE, "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise pytest.UsageError(
            f"{_VARIABLE}={name!r}: expected a torch device such as 'cpu' or 'cuda' ({err})"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{_VARIABLE}={name!r}: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}); install a CUDA build of torch, or unset {_VARIABLE} to "
            "test on the CPU"
        )
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"{_VARIABLE}={name!r}: expected 'cpu' or a 'cuda' device")
    return device


DEVICE = _test_device()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs CUDA (skipped, and said so, without it)")
    config.addinivalue_line(
        "markers",
        f"cpu_only: runs on the CPU only (skipped when {_VARIABLE} names another device)",
    )


def pytest_report_header() -> str:
    return f"gradkit test device: {DEVICE} ({_VARIABLE})"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("cuda") is not None and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available()"))
        if item.get_closest_marker("cpu_only") is not None and DEVICE.type != "cpu":
            item.add_marker(pytest.mark.skip(reason=f"CPU only; {_VARIABLE}={DEVICE}"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device under test (``GRADKIT_TEST_DEVICE``, default ``cpu``)."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed_and_device():
    torch.manual_seed(0)
    if DEVICE.type == "cpu":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.device(DEVICE):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
