"""GPU health checks through NVML (``nvidia-ml-py``), for the Guard's start-up check and ``trainguard health``.

A long training run is only as healthy as its worst GPU. NVIDIA's resiliency practice for large
(Megatron-style) jobs is to look at every GPU before training starts and again while it runs:

* **ECC errors** — uncorrected (double-bit) memory errors mean corrupted data may already have
  reached the computation;
* **page retirement** (pre-Ampere) and **row remapping** (Ampere and later) — a GPU with a retired
  page or a remapped row *pending* needs a reset before the repair takes effect, and a remapping
  *failure* means the memory can no longer be repaired;
* **clock throttling** — hardware or thermal slowdown makes one rank the straggler every other rank
  waits for;
* **temperature**, and the driver's own **GPU recovery action** (reset, reboot, drain).

A GPU with pending row remaps, a remapping failure or uncorrected ECC errors should be drained from
the job rather than trained on. On top of the NVML counters, :func:`compute_check` runs a small
matmul on each device and compares it with the CPU result.

On a machine without a GPU (or without NVML) nothing fails: :func:`gpu_report` says
``"skipped: no GPU"`` and why.
"""

from __future__ import annotations

import time
from typing import Any

import torch

UNSUPPORTED = "unsupported"

# Clock event ("throttle") reason bits, as in nvml.h (nvmlClocksEventReason*).
THROTTLE_BITS = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
SLOWDOWN_REASONS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")

# NVML_GPU_RECOVERY_ACTION_* values.
RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset"}


def _call(fn, *args) -> Any:
    """``fn(*args)``, or ``"unsupported"`` when NVML (or this pynvml) does not offer it here."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return UNSUPPORTED


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _throttle_reasons(pynvml, handle) -> list[str] | str:
    fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    mask = _call(fn, handle) if fn is not None else UNSUPPORTED
    if mask == UNSUPPORTED and hasattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons"):
        mask = _call(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    if mask == UNSUPPORTED:
        return UNSUPPORTED
    names = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_BITS)  # the bits are distinct, so their sum is their union
    return names + ([f"other_0x{rest:x}"] if rest else [])


def _recovery_action(pynvml, handle) -> str:
    field_id = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        return UNSUPPORTED
    values = _call(pynvml.nvmlDeviceGetFieldValues, handle, [field_id])
    if values == UNSUPPORTED or values[0].nvmlReturn != pynvml.NVML_SUCCESS:
        return UNSUPPORTED
    code = int(values[0].value.uiVal)  # the field is an unsigned int
    return RECOVERY_ACTIONS.get(code, f"unknown_{code}")


def _remapped_rows(pynvml, handle) -> dict[str, Any] | str:
    rows = _call(pynvml.nvmlDeviceGetRemappedRows, handle)
    if rows == UNSUPPORTED:
        return UNSUPPORTED
    corrected, uncorrected, pending, failure = rows
    return {"corrected": corrected, "uncorrected": uncorrected, "pending": bool(pending), "failure": bool(failure)}


def _retired_double_bit(pynvml, handle) -> int | str:
    pages = _call(pynvml.nvmlDeviceGetRetiredPages, handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    return pages if pages == UNSUPPORTED else len(pages)


def _problems(gpu: dict[str, Any], max_temperature_c: float) -> list[str]:
    found = []
    for key in ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate"):
        if isinstance(gpu[key], int) and gpu[key] > 0:
            found.append(f"{gpu[key]} uncorrected ECC errors ({key.rsplit('_', 1)[1]})")
    if gpu["retired_pages_pending"] is True:
        found.append("retired pages pending: reset the GPU")
    rows = gpu["remapped_rows"]
    if isinstance(rows, dict) and rows["pending"]:
        found.append("row remapping pending: reset the GPU")
    if isinstance(rows, dict) and rows["failure"]:
        found.append("row remapping failed: the GPU's memory cannot be repaired")
    if isinstance(gpu["throttle_reasons"], list):
        slow = [r for r in gpu["throttle_reasons"] if r in SLOWDOWN_REASONS]
        if slow:
            found.append("clocks slowed down: " + ", ".join(slow))
    temp = gpu["temperature_c"]
    if isinstance(temp, (int, float)) and temp >= max_temperature_c:
        found.append(f"temperature {temp} °C >= {max_temperature_c} °C")
    if gpu["recovery_action"] not in ("none", UNSUPPORTED):
        found.append(f"driver asks for recovery action: {gpu['recovery_action']}")
    return found


def gpu_health(index: int | None = None, max_temperature_c: float = 90.0) -> list[dict]:
    """Read the health counters of every GPU NVML sees (or only NVML index ``index``).

    NVML numbers GPUs physically: ``CUDA_VISIBLE_DEVICES`` does not renumber them (match by ``uuid``).

    Each dict holds ``index``, ``name``, ``uuid``, ``temperature_c`` (°C), ECC error counts
    ``ecc_uncorrected_volatile`` (since the driver loaded), ``ecc_uncorrected_aggregate``
    (lifetime), ``ecc_corrected_volatile``, ``retired_pages_double_bit`` (page count),
    ``retired_pages_pending`` (bool), ``remapped_rows`` ({corrected, uncorrected: row counts;
    pending, failure: bool}), ``throttle_reasons`` (list of reason names), ``recovery_action``
    (none / gpu_reset / node_reboot / drain_p2p / drain_and_reset), and ``problems`` (list of
    findings; empty when healthy; temperatures >= ``max_temperature_c`` count). A field this GPU
    or driver does not support is the string ``"unsupported"``.

    Raises:
        ImportError: ``nvidia-ml-py`` (the ``trainguard[gpu]`` extra) is not installed.
        pynvml.NVMLError: NVML cannot initialize (no driver), or ``index`` is not a GPU.
    """
    import pynvml

    pynvml.nvmlInit()  # reference-counted: nesting inside gpu_report's init is fine
    try:
        indices = range(pynvml.nvmlDeviceGetCount()) if index is None else [index]
        gpus = []
        for i in indices:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            ecc = pynvml.nvmlDeviceGetTotalEccErrors
            gpu = {
                "index": i,
                "name": _text(_call(pynvml.nvmlDeviceGetName, h)),
                "uuid": _text(_call(pynvml.nvmlDeviceGetUUID, h)),
                "temperature_c": _call(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
                "ecc_uncorrected_volatile": _call(
                    ecc, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                ),
                "ecc_uncorrected_aggregate": _call(
                    ecc, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC
                ),
                "ecc_corrected_volatile": _call(
                    ecc, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
                ),
                "retired_pages_double_bit": _retired_double_bit(pynvml, h),
                "retired_pages_pending": _call(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h),
                "remapped_rows": _remapped_rows(pynvml, h),
                "throttle_reasons": _throttle_reasons(pynvml, h),
                "recovery_action": _recovery_action(pynvml, h),
            }
            if gpu["retired_pages_pending"] != UNSUPPORTED:
                gpu["retired_pages_pending"] = gpu["retired_pages_pending"] == pynvml.NVML_FEATURE_ENABLED
            gpu["problems"] = _problems(gpu, max_temperature_c)
            gpus.append(gpu)
        return gpus
    finally:
        pynvml.nvmlShutdown()


def compute_check(device: torch.device | str, mb: int = 64) -> dict:
    """Allocate ``mb`` MiB on ``device``, multiply two 256×256 float32 matrices there and compare
    the product with the CPU's (``allclose``, rtol 1e-3). Works for ``"cpu"`` too.

    Returns ``{"device": str, "alloc_mb": mb, "ok": bool, "seconds": float (wall time of the whole
    check), "error": str | None}``. Never raises: any failure (no such device, out of memory, a
    wrong result) gives ``ok=False`` and a message in ``error``.
    """
    start = time.perf_counter()
    error = None
    try:
        dev = torch.device(device)
        block = torch.ones(mb * 2**20, dtype=torch.uint8, device=dev)  # touch the memory, not just reserve it
        gen = torch.Generator().manual_seed(0)
        a, b = torch.rand(256, 256, generator=gen), torch.rand(256, 256, generator=gen)  # >= 0: no cancellation
        product = (a.to(dev) @ b.to(dev)).cpu()
        if int(block.sum().item()) != mb * 2**20:
            error = f"{mb} MiB block on {dev} does not read back as written"
        elif not torch.allclose(product, a @ b, rtol=1e-3):
            error = f"matmul on {dev} differs from the CPU result"
        del block
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        error = f"{type(exc).__name__}: {exc}"
    return {
        "device": str(device),
        "alloc_mb": mb,
        "ok": error is None,
        "seconds": time.perf_counter() - start,
        "error": error,
    }


def gpu_report(max_temperature_c: float = 90.0) -> dict:
    """GPU health of this machine: NVML counters (:func:`gpu_health`) plus a :func:`compute_check`
    of every device torch can see.

    Returns ``{"status": "ok" | "problems", "gpus": [...], "compute": [...]}``, ``"problems"`` when
    any GPU has problems or any compute check failed; or ``{"status": "skipped: no GPU", "reason":
    ...}`` when ``torch.cuda.is_available()`` is False or NVML cannot initialize, and
    ``{"status": "skipped: nvidia-ml-py not installed", "reason": ...}`` without ``pynvml``. If an
    NVML query fails after a successful init, the status is ``"problems"`` with an ``"error"``.
    Never raises for a missing GPU, driver or library.
    """
    if not torch.cuda.is_available():
        return {"status": "skipped: no GPU", "reason": "torch.cuda.is_available() is False"}
    try:
        import pynvml
    except ImportError as exc:
        return {
            "status": "skipped: nvidia-ml-py not installed",
            "reason": f"{exc}; install it with: pip install 'trainguard[gpu]'",
        }
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"status": "skipped: no GPU", "reason": f"NVML: {exc}"}
    error = None
    try:
        gpus = gpu_health(max_temperature_c=max_temperature_c)
    except pynvml.NVMLError as exc:  # e.g. a GPU fell off the bus between init and the query
        gpus, error = [], f"NVML: {exc}"
    finally:
        pynvml.nvmlShutdown()
    compute = [compute_check(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    bad = error is not None or any(g["problems"] for g in gpus) or not all(c["ok"] for c in compute)
    report = {"status": "problems" if bad else "ok", "gpus": gpus, "compute": compute}
    return report if error is None else {**report, "error": error}
