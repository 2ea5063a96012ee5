"""Filling parameters from safetensors tensor by tensor, each in its parameter's own dtype.

A parameter's buffer is a NumPy array in its storage dtype (bf16 as its raw bits), created at its
first tensor; the tensors (or rows of a stacked expert parameter) are read straight into it and it
becomes the parameter's storage when complete (``Tensor.from_numpy`` shares the memory, so nothing
is copied). Beyond the parameters (those still filling included), memory holds at most the one
tensor being converted, when the file's dtype is not the parameter's.
"""

from collections import defaultdict
from typing import Optional

import numpy as np

from mindmoe.model.hf.config_map import HFCheckpointError
from mindmoe.model.hf.safetensors_io import READABLE_DTYPES, read_tensor_into

#: How the loader's notes name a storage dtype.
STORAGE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class ParamStreamer:
    """Fills parameters tensor by tensor: a parameter's buffer is created in its storage dtype at its
    first tensor and handed to it when its last row has arrived."""

    def __init__(self, params: dict):
        self.params = params
        self.pending = {}  # our name -> [buffer, rows still to come]
        self.converted = defaultdict(int)  # (file dtype, storage dtype) -> tensors

    def read(self, handle, entry, our_name: str, row: Optional[int], num_rows: int) -> None:
        param = self.params[our_name]
        storage = _storage_dtype(param)
        if our_name not in self.pending:
            self.pending[our_name] = [np.empty(tuple(param.shape), READABLE_DTYPES[storage][1]), num_rows]
        buffer = self.pending[our_name]
        try:
            read_tensor_into(handle, entry, buffer[0] if row is None else buffer[0][row], storage)
        except ValueError as err:
            raise HFCheckpointError(str(err)) from None
        if entry.dtype != storage:
            self.converted[(entry.dtype, storage)] += 1
        buffer[1] -= 1
        if buffer[1] == 0:
            param.set_data(_shared_tensor(self.pending.pop(our_name)[0], storage))

    def notes(self) -> list:
        return [
            f"{count} {dtype} tensors converted to {STORAGE_NAMES[storage]}"
            for (dtype, storage), count in sorted(self.converted.items())
        ]


def _storage_dtype(param) -> str:
    """The safetensors dtype a parameter's buffer is read as."""
    import mindspore as ms

    storage = {ms.float32: "F32", ms.float16: "F16", ms.bfloat16: "BF16"}.get(param.dtype)
    if storage is None:
        raise HFCheckpointError(f"{param.name}: parameters of dtype {param.dtype} cannot be loaded from safetensors")
    return storage


def _shared_tensor(buffer: np.ndarray, storage: str):
    """A MindSpore tensor on ``buffer``'s memory (no copy; bf16 is a view of its bits)."""
    import mindspore as ms
    from mindspore import Tensor

    tensor = Tensor.from_numpy(buffer)
    return tensor.view(ms.bfloat16) if storage == "BF16" else tensor
