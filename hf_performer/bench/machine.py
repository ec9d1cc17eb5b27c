"""What the benchmarks run on and how they read it: the machine record (CPU, threads, versions, date), the load
warning, a plain matmul's throughput, the synchronised clock, the process' memory (resident set, its peak), and
measurements run in a fresh process (:func:`run_in_fresh_process`)."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch


# ------------------------------------------------------------------------------------ the machine


def machine_info(device: torch.device) -> dict:
    """What ran the benchmark: CPU model, cores, device name, versions, date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu})",
    }
    return info


def machine_load_warning() -> str | None:
    """One line when the 1-minute load average is above half the cores (other work makes the timings noisy)."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return None
    if load <= 0.5 * cores:
        return None
    return (f"warning: the machine is loaded (1-minute load average {load:.1f} on {cores} cores): timings are noisy; "
            "rerun on an idle machine for numbers to quote")


def check_device(device: str) -> torch.device:
    """The torch device named ``device``; ``ValueError`` (one line) for a name torch does not know or a device this
    build or machine does not have (``cuda`` on a CPU-only torch)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"not a torch device name ({' '.join(str(error).split())}); e.g. cpu, cuda, cuda:1") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = f"this torch {torch.__version__} was built without CUDA" if torch.version.cuda is None else \
                "no CUDA device is visible"
            raise ValueError(f"{build}; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"there are {torch.cuda.device_count()} CUDA devices (0..{torch.cuda.device_count() - 1})")
    elif parsed.type not in ("cpu", "meta") and not getattr(torch, parsed.type, None):
        raise ValueError("this torch has no such backend; use --device cpu")
    return parsed


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, rounded; ``None`` where the platform has none."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def machine_record(start_load: list[float] | None, device: torch.device | None = None) -> dict:
    """:func:`machine_info` of ``device`` (the CPU by default) with the load averages at the start of a run
    (``start_load``, read by :func:`load_average` before it) and now."""
    return {**machine_info(device or torch.device("cpu")), "load_average": {"start": start_load, "end": load_average()}}


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Throughput of a plain square matmul: the compute floor the attention kernels are held to."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / min(timed_calls(lambda: a @ b, repeats, device)) / 1e9


# ------------------------------------------------------------------------------------ the clock


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_calls(call, repeats: int, device: torch.device, after=None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``call()``, after one untimed warm-up call.

    The clock stops once the device has finished; the call's result is released, and ``after()`` (if given)
    runs, outside the timed span.
    """
    timings = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        result = call()
        synchronize(device)
        timings.append(time.perf_counter() - start)
        del result
        if after is not None:
            after()
    return timings[1:]


# ------------------------------------------------------------------------------------ process memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status``, in bytes; the process' peak resident set where ``/proc`` is missing."""
    try:
        return _status_kib(field) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    """The process' resident set size (``VmRSS``)."""
    return _status_bytes("VmRSS")


def reset_peak_resident() -> None:
    """Reset the kernel's high-water mark of resident memory (Linux >= 4.0), so VmHWM is this call's."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def peak_resident_bytes() -> int:
    """The process' peak resident set size since the last :func:`reset_peak_resident` (``VmHWM``)."""
    return _status_bytes("VmHWM")


def _release_free_heap() -> None:
    """Give free heap memory back to the OS (glibc ``malloc_trim``), so that later allocations show in RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemoryGrowth:
    """Growth of peak memory during a ``with`` block (``growth``, bytes): CUDA allocator peak, or CPU peak
    resident set (VmHWM); ``None`` on a CPU whose peak cannot be reset."""

    def __init__(self, device: torch.device):
        self.device = device
        self.growth: int | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            gc.collect()
            _release_free_heap()  # freed temporaries must not hide the allocations of the steps
            self.base = resident_bytes()
            reset_peak_resident()
            # Without a working reset VmHWM keeps an older, higher peak: then no number is reported.
            self.valid = peak_resident_bytes() <= self.base + (64 << 20)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.growth = int(torch.cuda.max_memory_allocated(self.device) - self.base)
        elif self.valid:
            self.growth = max(peak_resident_bytes() - self.base, 0)
        return False


# ------------------------------------------------------------------------------------ fresh processes


class FreshProcessError(RuntimeError):
    """A measurement run by :func:`run_in_fresh_process` failed; the message is the child's last error line."""


def run_in_fresh_process(target: str, **arguments):
    """``module:function(**arguments)`` called in a new Python process (stdin closed), its JSON-serialisable return
    value returned: peak-memory measurements need a process whose earlier allocations and caches do not count.

    Raises:
        FreshProcessError: the child failed (its last stderr line, or its exit code).
    """
    module, function = target.split(":")
    code = ("import importlib, json, sys; arguments = json.loads(sys.argv[1]); "
            f"print(json.dumps(getattr(importlib.import_module({module!r}), {function!r})(**arguments)))")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(arguments)], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        raise FreshProcessError(lines[-1] if lines else f"exit code {result.returncode}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _median_of(values: list):
    """The median of numbers, or of dicts of numbers key by key."""
    if isinstance(values[0], dict):
        return {key: _median_of([value[key] for value in values]) for key in values[0]}
    return statistics.median(values)


def median_of_fresh_processes(target: str, processes: int, record_lists: dict[str, tuple], key: tuple[str, ...],
                              pooled: tuple[str, ...] = (), **arguments) -> dict:
    """``target`` (``module:function`` returning a benchmark result) run in ``processes`` fresh processes, one after
    the other, merged into the first run's result: in each list ``record_lists`` names, every field it names becomes
    the median over the runs (numbers, or dicts of numbers key by key), the runs' values kept beside it as
    ``process_FIELD`` (the spread between runs); the list fields ``pooled`` names (every timed call) are joined over
    the runs. Records are matched by the fields ``key`` (a name whose value is one record, not a list, is that
    record; ``None`` is skipped); the settings record ``processes``, the machine every run's date and load average.
    A noisy neighbour during one run, or one process's allocator, then does not decide a figure."""
    results = [run_in_fresh_process(target, **{**arguments, "progress": False}) for _ in range(processes)]
    merged = results[0]
    for list_name, fields in record_lists.items():
        if merged[list_name] is None:
            continue
        single = isinstance(merged[list_name], dict)  # one record, not a list
        for record in [merged[list_name]] if single else merged[list_name]:
            points = [result[list_name] if single else
                      next(other for other in result[list_name] if all(other[k] == record[k] for k in key))
                      for result in results]
            for field in fields:
                if field in record:
                    record[f"process_{field}"] = [point[field] for point in points]
                    record[field] = _median_of(record[f"process_{field}"])
            for field in pooled:
                if field in record:
                    record[field] = [value for point in points for value in point[field]]
    merged["settings"]["processes"] = processes
    merged["machine"]["runs"] = [
        {"date": result["machine"]["date"],
         "load_average": result["machine"].get("load_average", result["machine"].get("load_average_1_5_15min"))}
        for result in results]
    return merged
