"""A GPU machine as torch reports it, for tests of code that only reads torch's answers: `kernels`' variant
resolution and architecture check, and the package's import. Nothing can launch on it.

* `SimulatedGpu(setattr).cuda(capability)`: a CUDA build of torch (`torch.version.cuda` set, `hip`
  None) with one GPU of that compute capability.
* `SimulatedGpu(setattr).rocm(gfx)`: a ROCm build (`torch.version.hip` set, `cuda` None) with one GPU
  whose `gcnArchName` is the gfx name with the feature flags the driver appends on CDNA parts
  (`gfx942:sramecc+:xnack-`; RDNA parts report the bare name), as kernels 0.19's check reads it.

`setattr` is `monkeypatch.setattr` in a test (undone after it) or a plain patcher in a child process
(`SimulatedGpu.plain()`). kernels picks the backend from `torch.version` alone, then asks
`torch.cuda.is_available()` before its architecture check, which reads `get_device_capability()` (CUDA)
or `get_device_properties(current_device()).gcnArchName` (ROCm).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

CUDA_VERSION = "12.8"  # torch.version.cuda of a CUDA 12.8 wheel
HIP_VERSION = "6.4.43482-0f2d60242"  # torch.version.hip of a ROCm 6.4 wheel
# What the ROCm driver appends to a CDNA part's gfx name in gcnArchName (ECC on, XNACK off); kernels
# cuts gcnArchName at the first ':'.
CDNA_FLAGS = ":sramecc+:xnack-"
# RDNA parts (gfx10xx, gfx11xx, gfx12xx: consumer and workstation cards) report the bare gfx name.
RDNA_PREFIXES = ("gfx10", "gfx11", "gfx12")


# The package's cached device queries (`device._device_constant`), each asked once per device index.
DEVICE_PROBES = ("_capability", "_sm_count", "_shared_optin", "_gfx")


def fresh_device_probes(setattr, device) -> None:
    """Empties the caches of the package's device queries (``device``: its device module), so that they
    ask the simulated machine."""
    for probe in DEVICE_PROBES:
        setattr(device, probe, device._device_constant(getattr(device, probe).__wrapped__))


def gcn_arch_name(gfx: str) -> str:
    """gcnArchName as a ROCm torch reports it for a GPU of `gfx`."""
    return gfx if gfx.startswith(RDNA_PREFIXES) else gfx + CDNA_FLAGS


class SimulatedGpu:
    def __init__(self, setattr):
        self._set = setattr

    @classmethod
    def plain(cls) -> SimulatedGpu:
        """For a child process: patches stay for its lifetime."""
        return cls(lambda target, name, value: setattr(target, name, value))

    def _one_gpu(self) -> None:
        self._set(torch.cuda, "is_available", lambda: True)
        self._set(torch.cuda, "device_count", lambda: 1)
        self._set(torch.cuda, "current_device", lambda: 0)

    def cuda(self, capability: tuple[int, int]) -> None:
        self._set(torch.version, "cuda", CUDA_VERSION)
        self._set(torch.version, "hip", None)
        self._one_gpu()
        self._set(torch.cuda, "get_device_capability", lambda device=None: capability)

    def rocm(self, gfx: str) -> None:
        self._set(torch.version, "cuda", None)
        self._set(torch.version, "hip", HIP_VERSION)
        self._one_gpu()
        props = SimpleNamespace(gcnArchName=gcn_arch_name(gfx), name=f"AMD {gfx}")
        self._set(torch.cuda, "get_device_properties", lambda device=None: props)
