"""Dense peak FLOP/s of common accelerators, by device name and precision, and MFU against them.

MFU (model FLOPs utilization) is the share of the accelerator's dense peak that
the model's own arithmetic uses: ``tokens/s/device * FLOPs/token / peak``
(litft.model.flops counts the FLOPs).
"""

import re
from typing import Dict, Optional

from litft.errors import LitftError

# Dense (no 2:4 sparsity) peak TFLOP/s per device, from the vendors' datasheets; where a
# datasheet gives only the sparse figure (marked *), the dense one is half of it.
# "fp32" is the plain (CUDA-core / vector) rate; "tf32" the tensor-core rate for fp32
# matmuls when TF32 is enabled. fp16/bf16 are with fp32 accumulation, as training uses.
PEAK_TFLOPS: Dict[str, Dict[str, Optional[float]]] = {
    # H100 datasheet: SXM BF16/FP16 1,979*, TF32 989*, FP32 67; PCIe 1,513*, 756*, 51; NVL 1,671*, 835*, 60.
    "H100 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # H200 datasheet: the H100 SXM's compute with more memory; H200 NVL as the H100 NVL.
    "H200": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # GH200 datasheet: its Hopper GPU is rated as the H100 SXM (BF16 1,979*, TF32 989*, FP32 67).
    "GH200": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    # B200 (HGX, 1,000 W) datasheet: FP16/BF16 4.5 PF*, TF32 2.2 PF*, FP32 75 TF.
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    # A100 datasheet (40 GB and 80 GB, SXM and PCIe alike): BF16/FP16 312, TF32 156, FP32 19.5.
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # A10 datasheet: BF16/FP16 125, TF32 62.5, FP32 31.2.
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # A10G (AWS G5): no NVIDIA datasheet; the commonly cited figures (e.g. Baseten's
    # "A10 vs A10G"): BF16/FP16 70, TF32 35, FP32 35.
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 35.0},
    # L4 datasheet: BF16/FP16 242*, TF32 120*, FP32 30.3.
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # L40S datasheet: BF16/FP16 362.05 (733*), TF32 183 (366*), FP32 91.6.
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    # Ada whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate 165.2, TF32 82.6, FP32 82.6.
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    # Ampere GA102 whitepaper, RTX 3090: FP16/BF16 tensor with FP32 accumulate 71, TF32 35.6, FP32 35.6.
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    # V100 datasheet: SXM2 tensor (FP16) 125, FP32 15.7; PCIe 112, 14; V100S PCIe 130, 16.4.
    # Volta has neither bf16 nor TF32: fp32 matmuls run at the FP32 rate.
    "V100 SXM2": {"bf16": None, "fp16": 125.0, "tf32": 15.7, "fp32": 15.7},
    "V100 PCIe": {"bf16": None, "fp16": 112.0, "tf32": 14.0, "fp32": 14.0},
    "V100S PCIe": {"bf16": None, "fp16": 130.0, "tf32": 16.4, "fp32": 16.4},
    # AMD Instinct MI300X datasheet: FP16/BF16 1,307.4, TF32 653.7, FP32 (matrix and vector) 163.4.
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}

# torch.cuda.get_device_name() strings to table keys, tried in order: more specific names
# first ("GH200" before "H200", "H100 NVL"/"PCIe" before plain H100, "A10G" before "A10").
_DEVICE_PATTERNS = [
    (r"\bGH200\b", "GH200"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL"),
    (r"\bH200\b", "H200"),
    (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 ..."
    (r"\bB200\b", "B200"),  # not GB200, whose clocks and ratings differ
    (r"\bA100\b", "A100"),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB"
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bL40S\b", "L40S"),
    (r"\bL4\b", "L4"),
    (r"\bRTX 4090\b(?!\s*(D\b|Laptop))", "RTX 4090"),  # the 4090 D and the laptop part are other chips
    (r"\bRTX 3090\b(?!\s*(Ti\b|Laptop))", "RTX 3090"),
    (r"\bV100S\b", "V100S PCIe"),
    (r"\bV100\b.*\bPCIE\b", "V100 PCIe"),
    (r"\bV100\b", "V100 SXM2"),
    (r"\bMI300X\b", "MI300X"),
]


def device_key(device_name: str) -> Optional[str]:
    """The :data:`PEAK_TFLOPS` entry for a ``torch.cuda.get_device_name()`` string, or None."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, device_name or "", flags=re.IGNORECASE):
            return key
    return None


def precision_key(precision: str) -> Optional[str]:
    """Lightning precision flags ("bf16-mixed", "16-mixed", "32-true", ...) or dtype names to a table column.

    fp32 means the plain FP32 rate; pass "tf32" when TF32 matmuls are enabled
    (``torch.set_float32_matmul_precision("high")``). None for precisions the table lacks (fp8, fp64).
    """
    p = str(precision).lower()
    if "bf16" in p or "bfloat16" in p:
        return "bf16"
    if "tf32" in p:
        return "tf32"
    if "transformer-engine" in p or "8" in p or "64" in p:
        return None
    if "16" in p or "half" in p:
        return "fp16"
    if "32" in p or p in ("float", "single"):
        return "fp32"
    return None


def peak_flops(device_name: str, precision: str, override_tflops: Optional[float] = None) -> Optional[float]:
    """Dense peak FLOP/s of one device at a precision; None where unknown (the CPU, unlisted GPUs).

    ``override_tflops`` wins over the table, for unlisted hardware, power-capped parts or the CPU.
    """
    if override_tflops is not None:
        if not override_tflops > 0:
            raise LitftError(f"the peak TFLOP/s override must be positive, got {override_tflops}")
        return float(override_tflops) * 1e12
    key, column = device_key(device_name), precision_key(precision)
    if key is None or column is None:
        return None
    tflops = PEAK_TFLOPS[key].get(column)
    return None if tflops is None else tflops * 1e12


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization: the share of one device's peak FLOP/s the model's arithmetic uses."""
    if not peak:
        return None
    return tokens_per_s_per_device * flops_per_token / peak
