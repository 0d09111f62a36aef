"""Builds SGLang's CPU kernel package (`sgl_kernel`, with `sgl_kernel.common_ops`) from its
sources, against the torch already installed in the running interpreter.

Run by tools/sglang_cpu/setup.sh inside a copy of the pinned sources laid out as
    csrc/cpu/...   include/...   python/sgl_kernel/...
Why not SGLang's own CMake build: its find_package(Torch) fails against PyPI's CUDA torch
on a machine without the CUDA toolkit ("Caffe2 uses CUDA but I cannot find the CUDA
libraries"); a plain CppExtension needs only the torch headers and libraries.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
CPU = HERE / "csrc" / "cpu"
# Which of SGLang's two CPU builds (csrc/cpu/CMakeLists.txt), chosen by setup.sh from the host:
#   amx:  the x86_64 build, AVX-512 BF16/VNNI + AMX code paths (Intel Xeon 4th gen and later);
#   avx2: x86-64-v3 (AVX2 + FMA, e.g. AMD EPYC Zen 3): the same sources, whose AVX-512/AMX
#         code is behind CPU_CAPABILITY_AVX512 with generic fallbacks, and the op set SGLang
#         registers for CPUs without those kernels (SGLANG_CPU_ARM64_SKIP_X86_ONLY_OPS). Every
#         file is compiled: the registered MoE and int8 GEMM ops live in the "x86-only" files
#         (arm64 has its own NEON copies). SGLang then runs its torch-native layers and
#         attention (`cpu_has_amx_support()` is False) and uses the kernel for what is left.
ISA = os.environ.get("SGL_KERNEL_ISA", "amx")
ARCH_DIRS = {"aarch64", "ppc64"}
SOURCES = sorted(
    str(p.relative_to(HERE))
    for p in CPU.rglob("*.cpp")
    if not ARCH_DIRS & set(p.relative_to(CPU).parts[:-1])
)
# SGL_KERNEL_OPT: SGLang builds with -O3; -O1 compiles several times faster (for a quick
# build on a loaded machine, or the avx2 build, where SGLang calls few of these kernels).
OPT = os.environ.get("SGL_KERNEL_OPT", "-O3")
COMMON_FLAGS = [OPT, "-Wno-unknown-pragmas", "-fopenmp", "-DSGLANG_CPU_FP8_CVT_FTZ"]
ISA_FLAGS = {
    "amx": [
        "-march=x86-64-v4",
        "-mavx512bf16",
        "-mavx512vnni",
        "-mamx-tile",
        "-mamx-bf16",
        "-mamx-int8",
    ],
    "avx2": ["-march=x86-64-v3", "-DSGLANG_CPU_ARM64_SKIP_X86_ONLY_OPS"],
}
if ISA not in ISA_FLAGS:
    raise SystemExit(f"SGL_KERNEL_ISA must be one of {sorted(ISA_FLAGS)}, not {ISA!r}")
# torch >= 2.13 headers need C++20; SGLang's CMake says C++17 (it builds against 2.12).
CXX_FLAGS = COMMON_FLAGS + ISA_FLAGS[ISA] + ["-std=c++20"]

setup(
    name="sglang-kernel-cpu",
    version=os.environ.get("SGL_KERNEL_VERSION", "0.0.0+local"),
    description="SGLang's CPU kernels, built locally by kimi_pipe's tools/sglang_cpu",
    packages=[
        "sgl_kernel",
        "sgl_kernel.infllm_v2",
        "sgl_kernel.quantization",
        "sgl_kernel.testing",
    ],
    package_dir={"": "python"},
    ext_modules=[
        CppExtension(
            name="sgl_kernel.common_ops",
            sources=SOURCES,
            include_dirs=[str(CPU), str(HERE / "include")],
            extra_compile_args=CXX_FLAGS,
            libraries=["numa", "gomp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
