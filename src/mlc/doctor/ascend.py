"""Doctor check of an Ascend host: the /dev/davinci* nodes exist, this user may use them, torch_npu imports."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mlc.doctor.check import Check

_ASCEND_NODES = ("davinci_manager", "devmm_svm", "hisi_hdc")


def ascend_device_nodes(dev_dir: Path = Path("/dev")) -> list[Path]:
    return sorted(dev_dir.glob("davinci[0-9]*")) + [dev_dir / n for n in _ASCEND_NODES]


def check_ascend(dev_dir: Path = Path("/dev")) -> Check:
    """On an Ascend host (any /dev/davinci*): the device nodes exist and this user may read and write them,
    and torch_npu is importable."""
    import importlib.util

    cards = sorted(dev_dir.glob("davinci[0-9]*"))
    has_npu_lib = importlib.util.find_spec("torch_npu") is not None
    if not cards and not (dev_dir / "davinci_manager").exists():
        if has_npu_lib:
            return Check("ascend", "fail", "torch_npu is installed but there is no /dev/davinci* device node",
                         "pass the devices into the container: --device=/dev/davinci0 --device=/dev/davinci_manager "
                         "--device=/dev/devmm_svm --device=/dev/hisi_hdc")
        return Check("ascend", "skip", "not an Ascend host (no /dev/davinci*)")
    items, bad, owner_only = [], False, False
    for node in ascend_device_nodes(dev_dir):
        if not node.exists():
            items.append(f"{node}: missing")
            bad = True
            continue
        mode = node.stat().st_mode
        ok = os.access(node, os.R_OK | os.W_OK)
        group_rw = mode & 0o060 == 0o060  # crw-rw----: what a non-root container user in the group needs
        note = "" if ok else " (no read/write access for this user)"
        note += "" if group_rw or not ok else " (owner only: users other than root will see 'No device found')"
        items.append(f"{node}: {stat.filemode(mode)}{note}")
        bad |= not ok
        owner_only |= ok and not group_rw
    fix = ("sudo chmod 660 /dev/davinci* /dev/davinci_manager /dev/devmm_svm /dev/hisi_hdc && "
           "sudo usermod -a -G HwHiAiUser $USER (the nodes' group), then log in again and restart docker")
    if bad:
        return Check("ascend", "fail", f"{len(cards)} NPU node(s), but some device nodes are missing or not accessible",
                     fix, items)
    if owner_only:
        return Check("ascend", "warn", f"{len(cards)} NPU node(s) accessible here, but only to their owner", fix, items)
    if not has_npu_lib:
        return Check("ascend", "warn", f"{len(cards)} NPU node(s) accessible but torch_npu is not installed",
                     "pip install torch_npu matching your torch and CANN versions; source set_env.sh of CANN", items)
    return Check("ascend", "ok", f"{len(cards)} NPU node(s) accessible; torch_npu installed", items=items)
