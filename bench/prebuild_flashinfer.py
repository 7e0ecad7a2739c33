"""Compile, ahead of a device call, the FlashInfer modules agspec_gpu loads on an H200.

FlashInfer JIT-compiles each kernel module with nvcc at first use. On the device that costs
lease minutes, so this builds them here (any x86-64 machine with CUDA 13's nvcc; no GPU) for
sm_90a and lays them out as FlashInfer's AOT folder expects:

    <out>/<module name>/<module name>.so

`bench/device_check.sh` copies that folder into the installed package's `flashinfer/data/aot/`,
where FlashInfer looks before compiling; a module that fails to load there is compiled as usual.

The modules: batch prefill (fa2 backend, bf16, head dim 128, int32 indices), whose primary and
paged-KV parts serve both tree verification (`FlashInferPagedAttention`, custom mask) and the
tensor-core decode wrapper of the decode graphs (`DecodeGraphs`).

`bench/prepare_device_carry.sh` runs it with the environment it needs: FlashInfer and its
import-time dependencies on `PYTHONPATH`, `FLASHINFER_CUDA_ARCH_LIST=9.0a`, and a `CUDA_HOME`
whose `lib64/stubs/libcuda.so` is an empty stub with soname `libcuda.so.1` (linking wants
libcuda; the device's driver provides the real one at load time).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch


def specs(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128):
    try:
        from flashinfer.jit.attention import modules as m
    except ModuleNotFoundError as e:  # (the environment bench/prepare_device_carry.sh sets up)
        raise SystemExit(f"{e.name} is not importable: run this through "
                         f"bench/prepare_device_carry.sh, which installs FlashInfer's wheel "
                         f"and sets PYTHONPATH") from None

    args = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)
    return [m._gen_batch_prefill_primary_module("fa2", *args),
            m._gen_batch_prefill_independent_paged_module("fa2", *args)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="AOT folder to fill (e.g. .whl/flashinfer-aot)")
    args = p.parse_args()
    for spec in specs():
        t = time.perf_counter()
        spec.build()
        dst = args.out / spec.name / f"{spec.name}.so"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dst)
        print(f"{spec.name}: {dst.stat().st_size / 1e6:.1f} MB in "
              f"{time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
