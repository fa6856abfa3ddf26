"""How a result was made: the one record every output carries.

`collect()` gathers the git commit, the command line, the host, the Python / torch / CUDA / cuDNN /
NCCL versions, the devices and the environment variables that change communication; `write()`
puts it next to the resolved config in a JSON file. Training writes it as `run_info.json`, each
benchmark as `<name>_info.json`, a sweep as `manifest.json`: the same record everywhere, so a
number can always be traced back to the code and machine that produced it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit() -> str:
    """HEAD of the checkout ddp_lab runs from, with "-dirty" if it has uncommitted changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def collect(device: torch.device | str | None = None) -> dict:
    """Versions, devices, host and environment; `device`: the one the result was measured on."""
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    info = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "argv": sys.argv, "hostname": socket.gethostname(),
        "platform": platform.platform(), "python": sys.version.split()[0],
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # Other work on the machine shows up in every timing: record how busy it was.
        "loadavg_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
        "gpus": gpus, "gpu_count": len(gpus),
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    if device is not None:
        info.update(_device(torch.device(device)))
    return info


def _device(device: torch.device) -> dict:
    info = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}")
    return info


def write(path: str, config: dict, device=None, **extra) -> str:
    """`path` <- {"provenance": collect(device), "config": config, **extra}, as JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"provenance": collect(device), "config": config, **extra}, f, indent=2,
                  default=str)
    return path


def earlier_segments(path: str) -> list[dict]:
    """The records in a resumed run's `path` (run_info.json) before this segment writes its own:
    each earlier segment's, oldest first (none if it is not there)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        previous = json.load(f)
    return previous.pop("earlier", []) + [previous]
