"""How a run computes: the autocast dtype and memory format of its backbone, decided once per run.

CPU and GPU take the same path: the backbone and head run under ``torch.autocast`` when the device
computes a 16-bit float natively, with float32 weights and optimiser state; the loss always runs in
float32 (:class:`training.model.TrainingObjective`). Convolutions run in channels-last memory format,
which oneDNN on CPUs (and tensor cores on GPUs) prefer: together with bfloat16 they more than double a
training step's speed on a CPU that has it (docs/measurements.md; ``bench/train_speed.py`` measures it on
the machine at hand).

bfloat16 is used on a CPU only where it is native (``avx512_bf16`` or AMX on x86, the BF16 extension on
ARM): elsewhere torch emulates it, slower than float32 (``precision=bf16`` still forces it, with a
warning: to check its accuracy on such a machine). float16 is for GPUs without bfloat16 (it needs a
gradient scaler); a CPU never gets it.
"""

from __future__ import annotations

import contextlib
import platform
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from foundation.errors import InvalidInputError

Precision = Literal["auto", "fp32", "bf16", "fp16"]
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware, as torch's CPU feature detection (cpuinfo) says."""
    if platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    # On ARM oneDNN's check is the BF16 extension itself (x86's only asks for AVX-512 core, no bf16 units).
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_native_bf16()


@dataclass(frozen=True)
class Compute:
    """A run's resolved precision and memory format; :meth:`record` goes into ``config.json``."""

    device: torch.device
    autocast: torch.dtype | None  # None: float32 throughout
    channels_last: bool
    reason: str

    @property
    def precision(self) -> str:
        return DTYPE_NAMES[self.autocast]

    def autocast_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def prepare_module(self, module: nn.Module) -> nn.Module:
        """``module`` with its 4-d weights in the memory format of the run (in place, as ``to`` is)."""
        return module.to(memory_format=torch.channels_last) if self.channels_last else module

    def record(self) -> dict[str, Any]:
        return {
            "device": self.device.type,
            "precision": self.precision,
            "channels_last": self.channels_last,
            "reason": self.reason,
        }


def model_inputs(inputs: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Image batches and feature maps (4-d) in the model's memory format; other tensors as they are."""
    if channels_last and inputs.dim() == 4:
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs


def resolve_compute(precision: Precision, channels_last: bool, device: torch.device) -> Compute:
    """The run's compute for the ``precision`` setting: ``auto`` takes bfloat16 where ``device`` has it
    natively, float16 on a GPU without it, float32 otherwise. An explicit ``bf16`` is obeyed, with a
    warning where the device only emulates it; ``fp16`` is refused on a CPU."""
    bf16 = native_bf16(device)
    where = "GPU" if device.type == "cuda" else "CPU"
    if precision == "fp32":
        return Compute(device, None, channels_last, "precision=fp32: mixed precision turned off")
    if precision == "bf16" and not bf16:
        # Asked for explicitly (e.g. to check bfloat16's accuracy on a machine without it): done, and said.
        why = f"precision=bf16 asked for; this {where} emulates bfloat16, slower than float32"
        warnings.warn(why, stacklevel=2)
        return Compute(device, torch.bfloat16, channels_last, why)
    if precision == "bf16" or (precision == "auto" and bf16):
        return Compute(device, torch.bfloat16, channels_last, f"the {where} computes bfloat16 natively")
    if precision == "fp16" and device.type != "cuda":
        raise InvalidInputError(
            "precision=fp16 is for GPUs; on a CPU use precision=auto (bfloat16 where native)"
        )
    if device.type == "cuda":
        why = "precision=fp16" if precision == "fp16" else "the GPU has float16 but no bfloat16"
        return Compute(device, torch.float16, channels_last, why)
    return Compute(
        device, None, channels_last, f"the {where} has no native bfloat16 (float32 is faster there)"
    )
