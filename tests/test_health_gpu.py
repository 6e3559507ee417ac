"""GPU health checks (trainguard.health.gpu): real calls, no NVML mocks; the GPU test runs only on a GPU."""

from __future__ import annotations

import pytest
import torch

from trainguard.health.gpu import compute_check, gpu_report

GPU_KEYS = {
    "index",
    "name",
    "uuid",
    "temperature_c",
    "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate",
    "ecc_corrected_volatile",
    "retired_pages_double_bit",
    "retired_pages_pending",
    "remapped_rows",
    "throttle_reasons",
    "recovery_action",
    "problems",
}
COMPUTE_KEYS = {"device", "alloc_mb", "ok", "seconds", "error"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_report_without_gpu_is_skipped_with_a_reason():
    report = gpu_report()
    assert report["status"] == "skipped: no GPU"
    assert isinstance(report["reason"], str) and report["reason"]
    assert "gpus" not in report


def test_compute_check_on_cpu_passes():
    result = compute_check("cpu", mb=8)
    assert set(result) == COMPUTE_KEYS
    assert result["ok"] is True and result["error"] is None
    assert result["device"] == "cpu" and result["alloc_mb"] == 8
    assert 0 < result["seconds"] < 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_compute_check_on_missing_cuda_reports_instead_of_raising():
    result = compute_check("cuda", mb=1)
    assert result["ok"] is False
    assert isinstance(result["error"], str) and result["error"]
    assert result["device"] == "cuda" and result["seconds"] >= 0


def test_compute_check_on_bad_device_string_reports_instead_of_raising():
    result = compute_check("no-such-device")
    assert result["ok"] is False and "no-such-device" in result["error"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_report_on_gpu_has_every_documented_key():
    report = gpu_report()
    assert report["status"] in ("ok", "problems"), report
    assert report["gpus"], "NVML saw no GPU although CUDA is available"
    for gpu in report["gpus"]:
        assert GPU_KEYS <= set(gpu), GPU_KEYS - set(gpu)
        assert isinstance(gpu["problems"], list)
        assert gpu["throttle_reasons"] == "unsupported" or isinstance(gpu["throttle_reasons"], list)
        assert isinstance(gpu["remapped_rows"], (dict, str))
    assert len(report["compute"]) == torch.cuda.device_count()
    for check in report["compute"]:
        assert set(check) == COMPUTE_KEYS
        assert check["ok"], check["error"]
    if report["status"] == "ok":
        assert not any(gpu["problems"] for gpu in report["gpus"])
