"""Stored bytes per sample: the JPEG (quality 95) of a 256x256 photo / the kit's shard row of its codes (target >= 18x).

The paper streams VQGAN codes instead of images, about 18x fewer bytes. Here the codes are the
conservative case, 1024 codes drawn uniformly from the 8192-entry codebook (no trained tokenizer is
available offline), and the images are real photographs shipped inside installed packages. A second
row times decoding those shards through the training stream against decoding the JPEGs they replace.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import torch

from benchmarks import common

TITLE = "Code storage: JPEG bytes / stored codes, and streamed decoding"
HOW = """
Photographs: the color photographs that installed packages ship on disk, matplotlib's
`mpl-data/sample_data/grace_hopper.jpg` and, where scikit-image is installed, `skimage/data/`'s
astronaut, chelsea, coffee, rocket and motorcycle_left (its logos, textures, grayscale, microscopy and
medical images are left out); the benchmark fails if none is found. Each is prepared as the kit
prepares images for the 256x256 tokenizer (`collab_kit.model.vqgan.pil_to_tensor(image, size=256)`: shorter
side to 256, bicubic, center crop) and saved by PIL as JPEG quality 95 with PIL's default 4:2:0 chroma
subsampling (4:4:4, larger, is shown for comparison). Codes: 1024 per sample (a 32 x 32 grid) drawn
uniformly from 8192 (seed 0), whose 13 bits each no codec can shrink (floor 1024 x 13 / 8 = 1664 bytes);
a trained tokenizer's codes have lower entropy and compress better. `collab_kit.data.shards.write_shard`
writes 1000 such samples (200 with `--quick`) with captions of 60 characters on average (seeded word
sequences, about 22 bytes each once zstd-compressed), the photos' sizes and sequential 20-character
source ids (about 2 bytes each compressed), codebook 8192. The figure compares image with image: the
median over photos of JPEG bytes / the bytes the shard stores for a sample's image (its codes column,
length prefixes included, / samples); a JPEG dataset stores the same caption beside each image. The
details also give the whole row (the parquet file's size / samples: captions, other columns and footer
included) and the ratio against it, the codec's bytes alone (median `len(encode_codes(codes, 8192))`)
and int16 + Brotli (quality 11) of the same codes.
Streaming (one core: `torch.set_num_threads(1)` and pyarrow's CPU pool at 1): that shard is read back
through the training stream (`ShardStream(folder, text_length=256, image_length=1024,
shuffle_buffer=256, seed=0)` and `batches(stream, 16)`), timing 2000 samples (400 with `--quick`) after
a warm-up of 20 batches, against PIL decoding the photos' 256x256 JPEGs to RGB arrays on the same core
(images/s, best of 3); the figure is the ratio, the absolute rates are in the details with reading the
same number of raw int16 arrays by `np.frombuffer` (no decoding at all) as a ceiling.
"""

CODEBOOK_SIZE = 8192
IMAGE_SIDE = 32  # 32 x 32 = 1024 codes, the paper's grid
IMAGE_SIZE = 256  # the tokenizer's input
TEXT_LENGTH = 256
JPEG_QUALITY = 95
BATCH_SIZE = 16

# color photographs only: scikit-image's data folder also ships logos, textures, grayscale and medical images
SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png")

_WORDS = (
    "a photo of the old red house near river under a cloudy sky with two dogs playing in green "
    "field at sunset woman holding blue umbrella on busy street man riding bicycle along beach "
    "close up small white flower and yellow leaves wooden table kitchen cup coffee mountain lake "
    "snow city night lights car parked beside stone bridge vintage poster painting of cat"
).split()


def _package_dir(name: str) -> str:
    """Where an installed package lives, without importing it ('' if it is not installed)."""
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else ""


def find_photos() -> list[str]:
    """Paths of the real color photographs that installed packages ship."""
    candidates = []
    matplotlib_dir = _package_dir("matplotlib")
    if matplotlib_dir:
        candidates.append(os.path.join(matplotlib_dir, "mpl-data", "sample_data", "grace_hopper.jpg"))
    skimage_dir = _package_dir("skimage")
    if skimage_dir:
        candidates += [os.path.join(skimage_dir, "data", name) for name in SKIMAGE_PHOTOS]
    photos = [path for path in candidates if os.path.isfile(path)]
    if not photos:
        raise FileNotFoundError(
            "no photograph found on disk: expected matplotlib's mpl-data/sample_data/"
            "grace_hopper.jpg or scikit-image's skimage/data/ (astronaut.png, ...); install "
            "matplotlib or scikit-image in .venv"
        )
    return photos


def photo_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def prepare_photos(paths: Sequence[str]) -> list[dict]:
    """Each photo cropped to 256x256 as the kit prepares images, and its JPEG (quality 95) at 4:2:0 and 4:4:4."""
    from PIL import Image

    from collab_kit.model.vqgan import images_to_pil, pil_to_tensor

    photos = []
    for path in paths:
        with Image.open(path) as image:
            original_size = image.size
            crop = images_to_pil(pil_to_tensor(image, size=IMAGE_SIZE))[0]  # uint8 -> [0, 1] -> uint8 is exact
        jpegs = {}
        for label, subsampling in (("420", -1), ("444", 0)):  # -1: PIL's default, 4:2:0 at quality 95
            buffer = io.BytesIO()
            crop.save(buffer, format="JPEG", quality=JPEG_QUALITY, subsampling=subsampling)
            jpegs[label] = buffer.getvalue()
        photos.append(dict(name=photo_name(path), size=original_size, jpeg=jpegs["420"], jpeg444=jpegs["444"]))
    return photos


def make_captions(count: int, rng: np.random.Generator, mean_length: int = 60) -> list[str]:
    """Seeded word sequences of about ``mean_length`` characters (40 to 80)."""
    captions = []
    for _ in range(count):
        target = int(rng.integers(mean_length - 20, mean_length + 21))
        words: list[str] = []
        while len(" ".join(words)) < target:
            words.append(str(rng.choice(_WORDS)))
        captions.append(" ".join(words)[:target].rstrip())
    return captions


def write_codes_shard(folder: str, photos: Sequence[dict], num_samples: int, seed: int = 0) -> dict:
    """A shard of ``num_samples`` samples of uniform random codes; returns what it holds and its size."""
    import pyarrow.parquet as pq

    from collab_kit.data.shards import write_shard

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, CODEBOOK_SIZE, size=(num_samples, IMAGE_SIDE * IMAGE_SIDE), dtype=np.int64)
    captions = make_captions(num_samples, rng)
    sizes = [photos[i % len(photos)]["size"] for i in range(num_samples)]
    source_ids = [f"part-{i // 10000:05d}/{i:09d}" for i in range(num_samples)]  # 20 characters
    path = os.path.join(folder, "shard-00000.parquet")
    write_shard(
        path,
        captions,
        list(codes),
        codebook_size=CODEBOOK_SIZE,
        image_side=IMAGE_SIDE,
        sizes=sizes,
        source_ids=source_ids,
    )
    columns: dict[str, int] = {}  # bytes each column takes in the file, over all row groups
    metadata = pq.ParquetFile(path).metadata
    for group in range(metadata.num_row_groups):
        for index in range(metadata.num_columns):
            column = metadata.row_group(group).column(index)
            columns[column.path_in_schema] = columns.get(column.path_in_schema, 0) + column.total_compressed_size
    return dict(path=path, codes=codes, captions=captions, file_bytes=os.path.getsize(path), columns=columns)


def codec_sizes(codes: np.ndarray, count: int) -> dict[str, float]:
    """Median bytes of the kit's codec and of int16 + Brotli (quality 11) over the first ``count`` samples."""
    import brotli

    from collab_kit.data.codec import decode_codes, encode_codes

    kit, int16_brotli = [], []
    for sample in codes[:count]:
        data = encode_codes(sample, CODEBOOK_SIZE)
        if not np.array_equal(decode_codes(data, sample.size), sample):
            raise RuntimeError("encode_codes / decode_codes did not give the codes back")
        kit.append(len(data))
        int16_brotli.append(len(brotli.compress(sample.astype("<i2").tobytes(), quality=11)))
    return dict(kit=common.pick(kit, "median"), int16_brotli=common.pick(int16_brotli, "median"))


def make_stream(folder: str):
    """The training stream over ``folder``'s shards, batched as in training: the one place to switch it."""
    from collab_kit.data.stream import ShardStream, batches

    stream = ShardStream(
        folder, text_length=TEXT_LENGTH, image_length=IMAGE_SIDE * IMAGE_SIDE, shuffle_buffer=256, seed=0
    )
    return batches(stream, BATCH_SIZE)


def time_stream(folder: str, num_samples: int, warmup_batches: int = 20) -> dict[str, float]:
    """Samples per second read through ``make_stream`` (after a warm-up that fills the shuffle buffer)."""
    iterator = iter(make_stream(folder))
    for _ in range(warmup_batches):
        next(iterator)
    count, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while count < num_samples:
        batch = next(iterator)
        count += batch["image_codes"].shape[0]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if tuple(batch["image_codes"].shape) != (BATCH_SIZE, IMAGE_SIDE * IMAGE_SIDE):
        raise RuntimeError(f"the stream gave image codes of shape {tuple(batch['image_codes'].shape)}")
    return dict(rate=count / seconds, cpu_rate=count / cpu_seconds, samples=count)


def time_jpeg_decode(jpegs: Sequence[bytes], num_images: int, repeats: int = 3) -> float:
    """Images per second PIL decodes the JPEGs to RGB arrays (best of ``repeats``)."""
    from PIL import Image

    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(num_images):
            with Image.open(io.BytesIO(jpegs[i % len(jpegs)])) as image:
                pixels = np.asarray(image.convert("RGB"))
        rates.append(num_images / (time.perf_counter() - start))
    if pixels.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise RuntimeError(f"a JPEG decoded to shape {pixels.shape}")
    return common.pick(rates, "best")


def time_raw_int16(codes: np.ndarray, num_samples: int, repeats: int = 3) -> float:
    """Samples per second of ``np.frombuffer`` over raw int16 codes (no decoding at all): a ceiling."""
    raw = [sample.astype("<i2").tobytes() for sample in codes]
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(num_samples):
            torch.from_numpy(np.frombuffer(raw[i % len(raw)], dtype="<i2").astype(np.int64))
        rates.append(num_samples / (time.perf_counter() - start))
    return common.pick(rates, "best")


def on_one_core(function, *args, **kwargs):
    """``function(*args, **kwargs)`` with torch and pyarrow limited to one thread, restored afterwards."""
    import pyarrow as pa

    torch_threads, arrow_threads = torch.get_num_threads(), pa.cpu_count()
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    try:
        return function(*args, **kwargs)
    finally:
        torch.set_num_threads(torch_threads)
        pa.set_cpu_count(arrow_threads)


def measure(num_samples: int = 1000, stream_samples: int = 2000) -> dict:
    photos = prepare_photos(find_photos())
    with tempfile.TemporaryDirectory(prefix="collab_kit_bench_codes_") as folder:
        shard = write_codes_shard(folder, photos, num_samples)
        sizes = codec_sizes(shard["codes"], min(num_samples, 200))

        def speeds():
            return dict(
                stream=time_stream(folder, stream_samples),
                jpeg=time_jpeg_decode([photo["jpeg"] for photo in photos], max(200, stream_samples // 4)),
                raw=time_raw_int16(shard["codes"], stream_samples),
            )

        speed = on_one_core(speeds)
    stored = shard["file_bytes"] / num_samples
    caption_chars = float(np.mean([len(caption) for caption in shard["captions"]]))
    per_sample = {name: size / num_samples for name, size in shard["columns"].items()}
    return dict(
        photos=photos,
        stored=stored,
        caption_chars=caption_chars,
        num_samples=num_samples,
        **sizes,
        codes_column=per_sample["codes"],
        caption_column=per_sample["caption"],
        floor=IMAGE_SIDE * IMAGE_SIDE * bits_per_code() / 8,
        **speed,
    )


def bits_per_code() -> int:
    from collab_kit.data.codec import bits_per_code as bits

    return bits(CODEBOOK_SIZE)


def run(quick: bool = False) -> list[dict]:
    result = measure(num_samples=200 if quick else 1000, stream_samples=400 if quick else 2000)
    photos, stored = result["photos"], result["stored"]
    # the image against the image: a JPEG dataset stores the same caption beside each image, so the figure
    # compares the JPEG with what the shard stores for the image, its codes column; the whole row is in the details
    image_bytes = result["codes_column"]
    ratios = [len(photo["jpeg"]) / image_bytes for photo in photos]
    ratio = common.pick(ratios, "median")
    ratio444 = common.pick([len(photo["jpeg444"]) / image_bytes for photo in photos], "median")
    whole_row = common.pick([len(photo["jpeg"]) / stored for photo in photos], "median")
    for photo, photo_ratio in zip(photos, ratios):
        print(
            f"  {photo['name']} {photo['size'][0]}x{photo['size'][1]}: JPEG q95 {len(photo['jpeg'])} B (4:2:0), "
            f"{len(photo['jpeg444'])} B (4:4:4); {photo_ratio:.1f}x",
            flush=True,
        )
    print(
        f"  codes column {image_bytes:.0f} B/sample, whole row {stored:.0f} B/sample (codec {result['kit']:.0f} B, "
        f"int16+Brotli {result['int16_brotli']:.0f} B, "
        f"floor {result['floor']:.0f} B)",
        flush=True,
    )
    jpeg_list = ", ".join(f"{photo['name']} {len(photo['jpeg'])}" for photo in photos)
    storage_details = (
        f"{len(photos)} photo(s), JPEG q95 4:2:0 bytes of the 256x256 crop: {jpeg_list} (median ratio at 4:4:4: "
        f"{ratio444:.2f}x). Per sample: {image_bytes:.0f} B the codes column of the shard (the figure's denominator), "
        f"{stored:.0f} B the whole row (codes + {result['caption_chars']:.0f}-char caption over "
        f"{result['num_samples']} samples: {result['caption_column']:.0f} B the zstd captions, the rest other columns "
        f"and the footer; JPEG / whole row: {whole_row:.2f}x), "
        f"{result['kit']:.0f} B the codes alone (`encode_codes`), {result['int16_brotli']:.0f} B as int16 + "
        f"Brotli 11; the floor for 1024 uniform 13-bit codes is {result['floor']:.0f} B."
    )
    stream = result["stream"]
    speed_ratio = stream["rate"] / result["jpeg"]
    print(
        f"  stream {stream['rate']:.0f} samples/s ({stream['cpu_rate']:.0f} per CPU second), JPEG decode "
        f"{result['jpeg']:.0f} images/s, raw int16 {result['raw']:.0f} samples/s",
        flush=True,
    )
    speed_details = (
        f"One core: {stream['rate']:.0f} samples/s through `ShardStream` + `batches(16)` ({stream['samples']} samples "
        f"after a warm-up; {stream['cpu_rate']:.0f} per CPU second), against {result['jpeg']:.0f} images/s for PIL "
        f"decoding the 256x256 q95 JPEGs; reading raw int16 arrays with `np.frombuffer` gives {result['raw']:.0f} "
        f"samples/s."
    )
    return [
        common.make_row(
            __spec__.name,
            f"stored image bytes/sample, JPEG q95 256x256 / 1024 uniform codes in a shard "
            f"(median of {len(photos)} photo(s))",
            ratio,
            ">= 18",
            f"{ratio:.2f}x",
            storage_details,
            note="uniform codes: worst case" if ratio < 18 else "",
        ),
        common.make_row(
            __spec__.name,
            "decode speed on one core, shard stream samples/s / PIL JPEG images/s",
            speed_ratio,
            ">= 1",
            f"{speed_ratio:.1f}x",
            speed_details,
        ),
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
