"""JSON for everything in a checkpoint that is not a sharded tensor (no pickle anywhere: [Note: no pickle on load]
in memsave/dist/dcp.py): hyperparameters, non-tensor optimizer state, the loss scaler, ``extra``, RNG states."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch

__all__ = ["capture_rng", "decode", "encode", "restore_rng"]


def encode(value: Any, where: str) -> Any:
    """``value`` as JSON data: tuples, small tensors, dtypes and bytes are tagged so :func:`decode` restores them."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return {"__items__": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, torch.Tensor):
        if value.numel() > 4096:
            raise ValueError(f"{where}: a tensor of {value.numel()} elements is too large for the checkpoint's JSON "
                             "metadata; put tensors in the model or optimizer state")
        t = value.detach().cpu()
        return {"__tensor__": base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()
                if t.numel() else "", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    raise ValueError(f"{where}: a {type(value).__name__} cannot be stored in a checkpoint's JSON metadata; "
                     "allowed: None, bool, int, float, str, bytes, lists, tuples, dicts, dtypes and small tensors")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__float__" in value:
        return float(value["__float__"])
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    if "__dtype__" in value:
        dtype = getattr(torch, value["__dtype__"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"checkpoint metadata names dtype {value['__dtype__']!r}, which torch does not have")
        return dtype
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__tensor__" in value:
        dtype = decode({"__dtype__": value["dtype"]})
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(value["shape"]).clone()
    return {k: decode(v) for k, v in value.items()}


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's random state: Python's, torch's CPU generator and the device's (the TP region stream is drawn
    from the default generator at each unit's entry: [Note: TP random streams] in memsave/tp/random.py)."""
    out: dict[str, Any] = {"python": encode(random.getstate(), "python"), "cpu": encode(torch.get_rng_state().numpy()
                                                                                           .tobytes(), "cpu")}
    if device.type == "cuda":
        out["cuda"] = encode(torch.cuda.get_rng_state(device).numpy().tobytes(), "cuda")
    return out


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(decode(state["python"]))
    torch.set_rng_state(torch.frombuffer(bytearray(decode(state["cpu"])), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(decode(state["cuda"])), dtype=torch.uint8), device)
