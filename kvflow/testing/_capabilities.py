"""Capability probes behind the ``requires_*`` markers: ``None`` when present, else the reason."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess


@functools.cache
def rdma_missing() -> str | None:
    """Why RDMA tests cannot run here (no device, or no port ACTIVE); None when they can."""
    root = "/sys/class/infiniband"
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return f"no RDMA device ({root} is missing)"
    if not devices:
        return f"no RDMA device ({root} is empty)"
    states = []
    for dev in devices:
        ports = os.path.join(root, dev, "ports")
        try:
            for port in sorted(os.listdir(ports)):
                with open(os.path.join(ports, port, "state")) as f:
                    state = f.read().strip()  # "4: ACTIVE"
                if state.endswith("ACTIVE"):
                    return None
                states.append(f"{dev}/{port}: {state}")
        except OSError:
            states.append(f"{dev}: unreadable")
    return "no RDMA port is ACTIVE (" + ", ".join(states) + ")"


@functools.cache
def gpu_missing() -> str | None:
    """Why GPU tests cannot run here; None when ``nvidia-smi`` lists a GPU or torch sees CUDA."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"nvidia-smi -L failed ({exc})"
        else:
            if out.returncode == 0 and "GPU" in out.stdout:
                return None
            why = f"nvidia-smi -L lists no GPU ({(out.stderr or out.stdout).strip()[:120] or out.returncode})"
    else:
        why = "nvidia-smi not found"
    try:
        import torch
    except ImportError:
        return f"no GPU: {why}, and torch is not installed"
    try:
        if torch.cuda.is_available():
            return None
    except Exception as exc:  # a broken driver install
        return f"no GPU: {why}; torch.cuda failed: {exc}"
    return f"no GPU: {why}; torch.cuda.is_available() is False"


def transport_missing(name: str) -> str | None:
    """Why transport ``name`` cannot run here (not installed, or its own reason); None when it can."""
    from .._discovery import available_transports

    state = available_transports().get(name)
    if state is None:
        return f"transport {name!r} is not installed"
    return None if state == "ok" else f"transport {name!r} unavailable: {state}"
