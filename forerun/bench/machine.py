"""A few lines that say what machine a bench ran on, for the top of report.md."""
from __future__ import annotations

import os
import platform

import torch

from forerun import cpu


def describe(dtype: str, device: str, quantization: str | None, with_transformers: bool) -> dict[str, str]:
    info = {"CPU": cpu.name(), "threads": f"{torch.get_num_threads()} torch threads, "
                                           f"{os.cpu_count()} logical cores",
            "torch": torch.__version__, "python": platform.python_version()}
    if with_transformers:
        import transformers

        info["transformers"] = transformers.__version__
    info["device"] = device if not device.startswith("cuda") else f"{device} ({torch.cuda.get_device_name(device)})"
    info["dtype"] = dtype + (f", target weights {quantization}" if quantization else "")
    info["OS"] = f"{platform.system()} {platform.release()}"
    return info
