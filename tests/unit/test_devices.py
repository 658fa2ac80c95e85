"""trec_pipelines/testing/devices.py: the device and backend the distributed tier and the bench take
from TREC_DEVICE (a GPU host is simulated by patching torch.cuda's queries)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from trec_pipelines.testing import devices


@pytest.fixture(autouse=True)
def fresh_choice() -> Iterator[None]:
    devices.device_type.cache_clear()
    yield
    devices.device_type.cache_clear()


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("setting", [None, "", "auto", "cpu", "CPU"])
def test_cpu_host_runs_on_cpu_with_gloo(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    _gpus(monkeypatch, 0)
    if setting is None:
        monkeypatch.delenv(devices.ENV, raising=False)
    else:
        monkeypatch.setenv(devices.ENV, setting)
    assert (devices.device(), devices.backend()) == (torch.device("cpu"), "gloo")
    assert not devices.on_gpu()


def test_gpu_host_runs_on_the_local_rank_s_gpu_with_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    monkeypatch.delenv(devices.ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (devices.device(), devices.backend()) == (torch.device("cuda", 1), "nccl")


def test_cpu_can_be_asked_for_on_a_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    monkeypatch.setenv(devices.ENV, "cpu")
    assert (devices.device(), devices.backend()) == (torch.device("cpu"), "gloo")


def test_cuda_without_a_gpu_is_an_error_that_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _gpus(monkeypatch, 0)
    monkeypatch.setenv(devices.ENV, "cuda")
    with pytest.raises(RuntimeError, match="sees no GPU.*unset TREC_DEVICE"):
        devices.device()


def test_an_unknown_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devices.ENV, "tpu")
    with pytest.raises(ValueError, match="expected one of auto, cpu, cuda"):
        devices.backend()
