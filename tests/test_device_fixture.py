"""The device the tests run on comes from GRADKIT_TEST_DEVICE; asking for a device that is not
there stops the run with a usage error instead of testing the CPU under another name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu_only  # runs pytest itself in a subprocess

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_fixture_follows_the_variable(device):
    assert device == torch.device(os.environ.get("GRADKIT_TEST_DEVICE", "cpu"))
    assert torch.empty(1).device.type == device.type  # the default device of every test


def _pytest(device: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GRADKIT_TEST_DEVICE": device}
    test = "tests/test_device_fixture.py::test_the_device_fixture_follows_the_variable"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")
def test_asking_for_cuda_without_it_is_a_usage_error():
    done = _pytest("cuda")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "GRADKIT_TEST_DEVICE='cuda': torch.cuda.is_available() is False" in done.stderr


def test_an_unknown_device_is_a_usage_error():
    done = _pytest("tpu9")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "GRADKIT_TEST_DEVICE='tpu9': expected" in done.stderr
