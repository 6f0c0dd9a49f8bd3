"""The suite on a machine with a GPU: tests not marked ``gpu`` are CPU tests (gloo, CPU tensors, CPU figures), as
on this project's CI. On a CUDA machine each of them runs with CUDA hidden, from its setup on (before its
fixtures, module-scoped ones included): ``torch.cuda.is_available()`` is False in this process, and the processes
it starts see no GPU (``CUDA_VISIBLE_DEVICES=``; the fork server the multi-rank tests start from too, so a test
module imported in a rank, whose ``skipif(not torch.cuda.is_available())`` runs at import, finds no GPU), so
``memsave.init()`` picks the CPU and no two ranks share the one GPU. Tests marked ``gpu`` see the device. The
real device count is read once first, so that hiding the GPUs later never changes what this process finds.
"""

from __future__ import annotations

import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
_IS_AVAILABLE = torch.cuda.is_available
_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")


def _show_cuda(show: bool) -> None:
    torch.cuda.is_available = _IS_AVAILABLE if show else (lambda: False)  # type: ignore[assignment]
    if show and _VISIBLE is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = _VISIBLE if show and _VISIBLE is not None else ""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the item's fixtures are set up (module-scoped ones too, which start ranks)."""
    if _HAS_CUDA:
        _show_cuda(item.get_closest_marker("gpu") is not None)
