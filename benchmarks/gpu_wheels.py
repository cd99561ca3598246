"""The wheels the `device` tool's GPU machine lacks, for its Python 3.12, in `.whl/` (git-ignored, carried):

    python -m benchmarks.gpu_wheels      # here, where pip reaches the registries; about 42 MiB

Then, with the `device` tool (carry `.whl`), the command that measured benchmarks/RESULTS.md's GPU rows:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 python3 -m benchmarks.gpu_check --out $OUT/rows.json

and here, with the rows that came back: `python -m benchmarks.gpu_check --record rows.json`.

That machine's image has torch, transformers, scipy and pyarrow, but NumPy 2.5 (hivemind's 8-bit codec needs < 2.4)
and none of hivemind's own needs. bitsandbytes' wheel (43 MiB, one library per CUDA version) is cut to the library
of the machine's CUDA 13.0, to stay within the 64 MiB a call carries.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, ".whl")
BINARY = (
    "hivemind==1.1.12",
    "bitsandbytes==0.50.2",
    "numpy==2.3.5",
    "base58",
    "configargparse",
    "cryptography",
    "cffi",
    "pycparser",
    "netaddr",
    "py-cid",
    "py-multihash",
    "py-multibase",
    "py-multicodec",
    "blake3",
    "mmh3",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "protobuf",
    "brotli",
    "datasets",
    "dill",
    "multiprocess",
)
SOURCE_ONLY = ("prefetch_generator", "varint", "python-baseconv", "morphys")  # pure Python, built here
PLATFORMS = (
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
)
CUDA = "130"


def cut_bitsandbytes(wheel: str, cuda: str = CUDA) -> None:
    """Keep one CUDA library (and the CPU one) in bitsandbytes' wheel, and its RECORD in step."""
    dropped = re.compile(rf"bitsandbytes/libbitsandbytes_(cuda(?!{cuda}\.)|rocm|xpu)\w*\.so")
    cut = wheel + ".cut"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(cut, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if dropped.fullmatch(item.filename):
                continue
            data = source.read(item.filename)
            if item.filename.endswith("RECORD"):
                kept = [line for line in data.decode().splitlines() if not dropped.match(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            target.writestr(item, data)
    os.replace(cut, wheel)


def main() -> int:
    os.makedirs(WHEELS, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            WHEELS,
            *BINARY,
        ],
        check=True,
    )
    subprocess.run([*pip, "wheel", "--no-deps", "-w", WHEELS, *SOURCE_ONLY], check=True)
    for wheel in glob.glob(os.path.join(WHEELS, "bitsandbytes-*.whl")):
        cut_bitsandbytes(wheel)
    total = sum(os.path.getsize(path) for path in glob.glob(os.path.join(WHEELS, "*.whl")))
    print(f"{len(os.listdir(WHEELS))} wheels in {os.path.relpath(WHEELS)}: {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
