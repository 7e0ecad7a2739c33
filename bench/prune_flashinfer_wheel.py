"""Shrink the FlashInfer wheel to what the device check compiles, so it fits the 64 MiB carry.

FlashInfer's wheel (62 MB) ships the CUDA sources of every kernel family it can JIT-compile.
The device check compiles two: batch prefill with a custom mask (tree verification) and batch
decode (the plain-decode baseline). This copies the wheel, leaving out the source folders of
other kernel families (MoE, MLA, GDN, sampling, ...) and CUTLASS's examples, and rewrites the
wheel's RECORD to match. The Python package is untouched, so `import flashinfer` works as before;
only a kernel family whose sources were dropped would fail to compile.

    python bench/prune_flashinfer_wheel.py /tmp/dl/flashinfer_python-0.7.2.post1-py3-none-any.whl .whl/

writes the pruned wheel, under the same file name, into the carried folder and prints the sizes.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import zipfile

# Paths (inside the wheel) the prefill/decode JIT reads: data/include, data/cccl, data/spdlog,
# data/cutlass/include and the top-level files of data/csrc. Everything matching DROP goes.
DROP = re.compile(
    r"^flashinfer/data/csrc/[^/]+/"  # every kernel family's source folder
    r"|^flashinfer/data/csrc/(cake_|alphamoe)"  # and their top-level sources
    r"|^flashinfer/data/cutlass/(examples|python|tools|test|docs|media)/"
    r"|^flashinfer/moe_ep/kernel_src/"
    r"|^flashinfer/experimental/[^/]+/csrc/"
)
KEEP = re.compile(r"^flashinfer/data/(include|cccl|spdlog|cutlass/include)/")


def prune(src: pathlib.Path, dst: pathlib.Path) -> tuple[int, int]:
    """Writes the pruned wheel to `dst`; returns (files kept, files dropped)."""
    kept, dropped = [], 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            name = info.filename
            if name == record_name:
                continue
            if DROP.search(name) and not KEEP.match(name):
                dropped += 1
                continue
            zout.writestr(info, zin.read(name))
            kept.append(name)
        names = set(kept)
        lines = [
            ln for ln in zin.read(record_name).decode().splitlines() if ln.split(",", 1)[0] in names
        ]
        lines.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(lines) + "\n")
    return len(kept), dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel", type=pathlib.Path, help="the downloaded wheel")
    p.add_argument("out_dir", type=pathlib.Path, help="folder for the pruned wheel (same name)")
    args = p.parse_args()
    dst = args.out_dir / args.wheel.name
    if dst.resolve() == args.wheel.resolve():
        p.error("out_dir must not be the wheel's own folder")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    kept, dropped = prune(args.wheel, dst)
    print(
        f"{dst}: {args.wheel.stat().st_size / 1e6:.1f} MB -> "
        f"{dst.stat().st_size / 1e6:.1f} MB ({kept} files kept, {dropped} dropped)"
    )


if __name__ == "__main__":
    main()
