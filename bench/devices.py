"""The device a benchmark runs on, from its ``--device`` argument.

A benchmark asked for a GPU that this torch cannot use (a CPU build, no GPU visible) stops
with a message naming ``--device`` instead of a traceback from the first tensor put there;
on the CPU it times with one thread, as ``bench/results/README.md`` says the CPU files do
(the default thread count follows the machine's load: a shared 2-core machine moved one
kernel's time 290-fold).
"""

from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    """``name`` as a device: ``"auto"`` is CUDA when torch sees a GPU, else the CPU.

    Raises:
        SystemExit: ``name`` is not a device, or a CUDA device this process cannot use.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise SystemExit(f"--device: {name!r} is not a device ({e})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SystemExit(f"--device {name}: torch {torch.__version__} sees no CUDA GPU "
                             f"here; run it on a GPU machine (bench/device_check.sh) or pass "
                             f"--device cpu")
        if dev.index is not None and dev.index >= count:
            raise SystemExit(f"--device {name}: torch sees {count} CUDA GPU(s)")
    return dev


def cpu_threads(dev: torch.device) -> None:
    """Times on ``dev`` with one CPU thread when it is the CPU (the results' config records
    ``torch.get_num_threads()``); on a GPU the thread count is left as it is."""
    if dev.type == "cpu":
        torch.set_num_threads(1)


def device_slug(dev: torch.device) -> str:
    """What results files name ``dev`` by: ``"cpu"``, or the GPU's name in lower case
    without the vendor, other characters as ``-`` (``"NVIDIA H100 80GB HBM3"``:
    ``"h100-80gb-hbm3"``)."""
    if dev.type != "cuda":
        return dev.type
    return slug(torch.cuda.get_device_name(dev))


def slug(text: str) -> str:
    """``text`` (a GPU's name) as a file-name part: lower case, no ``nvidia``, other
    characters than letters and digits as ``-``."""
    t = text.lower().replace("nvidia", "").strip()
    return "".join(c if c.isalnum() else "-" for c in t).strip("-") or "gpu"
