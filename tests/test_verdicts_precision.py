"""Kernel precision from names and device capability from properties or name (anchors §9)."""

from __future__ import annotations

import pytest

from stepdoctor_analysis.analyzers.precision import device_caps, matmul_precision
from stepdoctor_analysis.model.trace import DeviceInfo


@pytest.mark.parametrize(
    ("name", "precision"),
    [
        ("volta_sgemm_128x64_nn", "fp32"),
        ("ampere_sgemm_32x128_tn", "fp32"),
        ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 4, 4>", "fp32"),
        ("volta_scudnn_128x64_relu_interior_nn_v1", "fp32"),
        ("sm80_xmma_gemm_tf32f32_tf32f32_f32_nn_n_tilesize128x128x32", "tf32"),
        ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", "tf32"),
        ("volta_h884gemm_64x64_ldg8_nn", "fp16"),
        ("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_tn", "fp16"),
        ("volta_fp16_scudnn_fp16_128x128_stridedB_splitK_interior_nn_v1", "fp16"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "bf16"),
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>",
            "bf16",
        ),
        ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128", "fp8"),
        ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT64x32x256", "bf16"),
        ("Cijk_Alik_Bljk_B_BS_BH_Bias_HA_S_SAV_UserArgs_MT16x16x128", "bf16"),
        ("Cijk_Alik_Bljk_HHS_BH_MT128x128x32", "fp16"),
        ("Cijk_Ailk_Bljk_SS_BH_MT64x64x16", "fp32"),
        ("attn_fwd", "unknown"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", None),
        ("void convert_fp8_kernel(float*)", None),
    ],
)
def test_matmul_precision_from_kernel_names(name: str, precision: str | None) -> None:
    assert matmul_precision(name) == precision


def _dev(name: str, major: int = 0, minor: int = 0) -> DeviceInfo:
    return DeviceInfo(0, name, 0, 0, major, minor)


@pytest.mark.parametrize(
    ("device", "amd", "dtype", "tf32"),
    [
        (_dev("Tesla V100-SXM2-32GB", 7, 0), False, "float16", False),
        (_dev("Tesla T4", 7, 5), False, "float16", False),
        (_dev("NVIDIA A100-SXM4-80GB", 8, 0), False, "bfloat16", True),
        (_dev("NVIDIA H100 80GB HBM3", 9, 0), False, "bfloat16", True),
        (_dev("Tesla P100-PCIE-16GB", 6, 0), False, None, False),
        # Names decide when the properties lack a capability.
        (_dev("Tesla V100-SXM2-16GB"), False, "float16", False),
        (_dev("NVIDIA A100-PG509-200"), False, "bfloat16", True),
        # AMD reports gfx versions as 9.x: never read them as sm_90.
        (_dev("AMD Instinct MI300X", 9, 4), False, "bfloat16", False),
        (_dev("AMD Instinct MI210", 9, 0), False, "bfloat16", False),
        (_dev("", 9, 4), True, "bfloat16", False),
        (None, False, None, False),
    ],
)
def test_device_capabilities(device: DeviceInfo | None, amd: bool, dtype: str | None, tf32: bool) -> None:
    caps = device_caps(device, amd=amd)
    assert caps.autocast_dtype == dtype
    assert caps.tf32 is tf32
