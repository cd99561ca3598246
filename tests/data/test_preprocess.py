"""Preprocessing: images + captions -> the paper's filters -> VQGAN codes -> parquet shards -> the Hub.

Every image is drawn here (PIL / numpy); the tokenizer is the tiny VQGAN (16x16 images -> 4x4 codes of 32)
with fresh weights. The Hub is the stand-in of hub_server.py, talked to by the real client in a subprocess.
"""

import io
import json
import os
import subprocess
import sys
import tarfile

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from collab_kit.cli import make_parser
from collab_kit.data.codec import decode_codes
from collab_kit.data.preprocess import (
    ASPECT_RATIO,
    MISSING_CAPTION,
    MISSING_IMAGE,
    NSFW,
    SHORT_CAPTION,
    UNREADABLE_IMAGE,
    PushError,
    drop_reason,
    preprocess,
)
from collab_kit.data.shards import shard_metadata
from collab_kit.data.sources import SOURCE_FORMATS, PairSource, read_pairs
from collab_kit.data.stream import ShardStream
from collab_kit.data.tokenizers import ByteCaptionTokenizer
from collab_kit.model.vqgan import TINY_VQGAN_CONFIG, build_vqgan, pil_to_tensor
from collab_kit.model.vqgan_files import save_vqgan

SIDE = 16  # the tiny VQGAN's image_size


@pytest.fixture(scope="module")
def vqgan():
    torch.manual_seed(0)
    return build_vqgan(TINY_VQGAN_CONFIG).eval()


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def truncated_png(width: int, height: int, seed: int) -> bytes:
    """A PNG whose header is whole (its size can be read) but whose pixels stop half-way: it does not decode."""
    data = encoded(noise_image(width, height, seed))
    return data[: len(data) // 2]


def read_shard_rows(folder) -> list:
    """Every row of the shards in ``folder``, in order, with its codes decoded."""
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("shard-") and name.endswith(".parquet"):
            for row in pq.read_table(os.path.join(folder, name)).to_pylist():
                rows.append(dict(row, codes=decode_codes(row["codes"]).tolist(), shard=name))
    return rows


def direct_codes(vqgan, image: Image.Image) -> list:
    """The codes of the image's center crop, encoded alone: what a shard must hold."""
    return vqgan.encode(pil_to_tensor(image, size=SIDE))[0].tolist()


def make_captioned_folder(folder, count: int, *, truncated=()):
    """``count`` PNG images of assorted sizes (aspect ratios up to 2) named in captions.jsonl; returns the images."""
    os.makedirs(folder, exist_ok=True)
    images = {}
    with open(os.path.join(folder, "captions.jsonl"), "w") as f:
        for i in range(count):
            name = f"img{i:03d}.png"
            width, height = (SIDE + 3 * (i % 6), SIDE + 2 * (i % 5))
            if i in truncated:
                with open(os.path.join(folder, name), "wb") as image_file:
                    image_file.write(truncated_png(width, height, seed=i))
            else:
                images[name] = noise_image(width, height, seed=i)
                images[name].save(os.path.join(folder, name))
            f.write(json.dumps({"file": name, "caption": f"  picture number {i}\n"}) + "\n")
    return images


# ---------------------------------------------------------------------------------------------
# codes, shards and filters


def test_shards_hold_the_codes_of_the_center_crops(tmp_path, vqgan):
    images = make_captioned_folder(tmp_path / "images", 11)
    report = preprocess(
        str(tmp_path / "images"), str(tmp_path / "shards"), vqgan, rows_per_shard=4, batch_size=3, progress=False
    )

    names = sorted(os.listdir(tmp_path / "shards"))
    assert names == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    rows = read_shard_rows(tmp_path / "shards")
    assert [row["shard"] for row in rows] == [names[0]] * 4 + [names[1]] * 4 + [names[2]] * 3  # the last is shorter
    assert [row["source_id"] for row in rows] == sorted(images)  # in the order of the file names
    for row in rows:
        image = images[row["source_id"]]
        assert row["codes"] == direct_codes(vqgan, image), row["source_id"]
        assert (row["width"], row["height"]) == image.size  # the original's size, before the crop
        assert row["caption"] == f"picture number {int(row['source_id'][3:6])}"  # stripped
    # a squashed (uncropped) resize gives other codes: the comparison above can tell the crop apart
    squashed = [vqgan.encode(pil_to_tensor(images[row["source_id"]].resize((SIDE, SIDE))))[0].tolist() for row in rows]
    assert squashed != [row["codes"] for row in rows]
    for name in names:
        assert shard_metadata(str(tmp_path / "shards" / name)) == dict(format=2, codebook_size=32, image_side=4)

    assert report.kept == 11 and report.dropped == {} and report.encoded == 11
    assert [os.path.basename(path) for path in report.shards_written] == names and report.shards_skipped == []
    sizes = sum(os.path.getsize(tmp_path / "shards" / name) for name in names)
    assert report.bytes_written == report.bytes_total == sizes
    assert "kept 11 of 11 pairs" in report.summary() and "3 written" in report.summary()


def test_the_paper_filters_drop_what_they_should_and_count_it(tmp_path, vqgan):
    # a LAION-like parquet file: image bytes, a caption and an NSFW label per row
    rows = [  # (caption, image bytes, NSFW label)
        ("a kept picture", encoded(noise_image(20, 16, 0)), "UNLIKELY"),
        ("ab", encoded(noise_image(16, 16, 1)), "UNLIKELY"),  # a caption of 2 characters
        ("   x y  ", encoded(noise_image(16, 16, 2)), "UNLIKELY"),  # 3 characters once stripped: kept
        ("wide", encoded(noise_image(48, 16, 3)), "UNLIKELY"),  # aspect ratio 3:1
        ("tall, exactly 2:1", encoded(noise_image(16, 32, 4)), "UNLIKELY"),  # 2 is allowed
        ("a nsfw picture", encoded(noise_image(16, 16, 5)), "NSFW"),
        ("an unsure picture", encoded(noise_image(16, 16, 6)), "UNSURE"),
        ("no label at all", encoded(noise_image(18, 16, 7)), None),  # no label: kept
        ("not an image", b"these bytes are no image", "UNLIKELY"),
        ("half an image", truncated_png(16, 16, 8), "UNLIKELY"),  # the header reads, the pixels do not
        (None, encoded(noise_image(16, 16, 9)), "UNLIKELY"),
    ]
    table = pa.table({"jpg": [r[1] for r in rows], "caption": [r[0] for r in rows], "NSFW": [r[2] for r in rows]})
    pq.write_table(table, tmp_path / "laion.parquet")

    report = preprocess(
        str(tmp_path / "laion.parquet"), str(tmp_path / "shards"), vqgan, rows_per_shard=100, progress=False
    )
    assert report.dropped == {SHORT_CAPTION: 1, ASPECT_RATIO: 1, NSFW: 2, UNREADABLE_IMAGE: 2, MISSING_CAPTION: 1}
    kept = read_shard_rows(tmp_path / "shards")
    assert [row["source_id"] for row in kept] == [
        "laion.parquet:0",
        "laion.parquet:2",
        "laion.parquet:4",
        "laion.parquet:7",
    ]
    assert [row["caption"] for row in kept] == ["a kept picture", "x y", "tall, exactly 2:1", "no label at all"]
    assert report.kept == 4 and report.pairs == len(rows) and report.encoded == 4
    for row in kept:
        image = Image.open(io.BytesIO(rows[int(row["source_id"].split(":")[1])][1]))
        assert row["codes"] == direct_codes(vqgan, image)
    summary = report.summary()
    assert "kept 4 of 11 pairs" in summary and "nsfw 2" in summary and "unreadable_image 2" in summary

    # the rules one by one
    assert drop_reason("abc") is None and drop_reason("ab ") == SHORT_CAPTION and drop_reason(None) == MISSING_CAPTION
    assert drop_reason("fine", "unlikely") is None and drop_reason("fine", "UNSURE") == NSFW
    assert drop_reason("fine", "", (10, 10)) is None and drop_reason("fine", None, (201, 100)) == ASPECT_RATIO

    # the first N pairs only (the paper took LAION's first 100M)
    report = preprocess(
        PairSource(str(tmp_path / "laion.parquet"), max_samples=3), str(tmp_path / "first3"), vqgan, progress=False
    )
    assert report.pairs == 3 and report.kept == 2 and report.dropped == {SHORT_CAPTION: 1}


def test_a_second_run_writes_only_the_missing_shard(tmp_path, vqgan):
    # images 1 and 6 do not decode: one falls in shard 0 (skipped on the second run), one in shard 1 (rewritten)
    make_captioned_folder(tmp_path / "images", 14, truncated=(1, 6))
    output = tmp_path / "shards"
    first = preprocess(str(tmp_path / "images"), str(output), vqgan, rows_per_shard=4, batch_size=3, progress=False)
    names = sorted(os.listdir(output))
    assert len(names) == 3 and first.kept == 12 and first.dropped == {UNREADABLE_IMAGE: 2}
    contents = {name: (output / name).read_bytes() for name in names}
    stats = {name: os.stat(output / name) for name in names}

    os.remove(output / names[1])
    written = []
    second = preprocess(
        str(tmp_path / "images"),
        str(output),
        vqgan,
        rows_per_shard=4,
        batch_size=3,
        progress=False,
        on_shard_written=written.append,
    )
    assert written == [str(output / names[1])] and second.shards_written == written
    assert second.shards_skipped == [str(output / names[0]), str(output / names[2])]
    assert second.encoded == 4  # the missing shard's images only
    assert (output / names[1]).read_bytes() == contents[names[1]]  # the same bytes as the first time
    for name in (names[0], names[2]):  # untouched: same file, same time
        now = os.stat(output / name)
        assert (now.st_ino, now.st_mtime_ns) == (stats[name].st_ino, stats[name].st_mtime_ns)
    assert (second.kept, second.dropped, second.bytes_total) == (first.kept, first.dropped, first.bytes_total)

    third = preprocess(str(tmp_path / "images"), str(output), vqgan, rows_per_shard=4, progress=False)
    assert third.shards_written == [] and third.encoded == 0 and len(third.shards_skipped) == 3
    assert "0 written" in third.summary() and "3 already there" in third.summary()


def test_shards_of_another_vqgan_or_other_input_are_refused(tmp_path, vqgan):
    make_captioned_folder(tmp_path / "images", 6)
    preprocess(str(tmp_path / "images"), str(tmp_path / "shards"), vqgan, rows_per_shard=4, progress=False)

    config = json.loads(json.dumps(TINY_VQGAN_CONFIG))
    config["params"]["n_embed"] = 64
    with pytest.raises(ValueError, match=r"another tokenizer .*codebook 32.* than this VQGAN's .*codebook 64"):
        preprocess(str(tmp_path / "images"), str(tmp_path / "shards"), build_vqgan(config), progress=False)

    # an image added in the middle of the input: the shards no longer follow it
    noise_image(SIDE, SIDE, 99).save(tmp_path / "images" / "img000b.png")
    with open(tmp_path / "images" / "captions.jsonl", "a") as f:
        f.write(json.dumps({"file": "img000b.png", "caption": "a newcomer"}) + "\n")
    with pytest.raises(ValueError, match="input changed since the shards were written"):
        preprocess(str(tmp_path / "images"), str(tmp_path / "shards"), vqgan, rows_per_shard=4, progress=False)


# ---------------------------------------------------------------------------------------------
# the sources


def test_a_folder_with_sidecar_captions(tmp_path, vqgan):
    folder = tmp_path / "images"
    (folder / "cats").mkdir(parents=True)
    images = {
        "cats/1.png": noise_image(20, 16, 1),
        "cats/2.webp": noise_image(16, 24, 2),
        "dog.bmp": noise_image(16, 16, 3),
        "no_caption.png": noise_image(16, 16, 4),
    }
    for name, image in images.items():
        image.save(folder / name, lossless=True) if name.endswith(".webp") else image.save(folder / name)
    (folder / "cats" / "1.txt").write_text("a cat\n")
    (folder / "cats" / "2.txt").write_text("another cat")
    (folder / "dog.txt").write_text("a dog")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (folder / "broken.txt").write_text("a broken image")
    (folder / "notes.md").write_text("not an image, not a caption")

    report = preprocess(str(folder), str(tmp_path / "shards"), vqgan, progress=False)
    rows = read_shard_rows(tmp_path / "shards")
    assert [(row["source_id"], row["caption"]) for row in rows] == [
        ("cats/1.png", "a cat"),
        ("cats/2.webp", "another cat"),
        ("dog.bmp", "a dog"),
    ]
    for row in rows:
        assert row["codes"] == direct_codes(vqgan, images[row["source_id"]])
    assert report.dropped == {UNREADABLE_IMAGE: 1, MISSING_CAPTION: 1}


def test_captions_files_tsv_and_csv(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("a.png", "b.jpg"):
        noise_image(16, 16, 0).save(folder / name)
    (folder / "captions.tsv").write_text('file\tcaption\na.png\ta red, round thing\n\nb.jpg\tsomething "quoted"\n')
    assert [(p.source_id, p.caption) for p in read_pairs(str(folder))] == [
        ("a.png", "a red, round thing"),
        ("b.jpg", 'something "quoted"'),
    ]
    os.remove(folder / "captions.tsv")
    (folder / "captions.csv").write_text('a.png,"a red, round thing"\nb.jpg,plain\n')
    assert [(p.source_id, p.caption) for p in read_pairs(str(folder))] == [
        ("a.png", "a red, round thing"),
        ("b.jpg", "plain"),
    ]
    # the command line offers every format the reader knows (its module imports no torch: --help stays quick)
    assert (
        make_parser().parse_args(["preprocess", "x", "--output", "o", "--vqgan", "v", "--format", "disk"]).format
        == "disk"
    )
    assert {
        action.dest: action.choices
        for action in make_parser()._subparsers._group_actions[0].choices["preprocess"]._actions
    }["format"] == SOURCE_FORMATS

    # two captions files, an image named twice, a line that is not JSON: errors that say where
    (folder / "captions.jsonl").write_text('{"file": "a.png", "caption": "x y z"}\n')
    with pytest.raises(ValueError, match="keep one captions file"):
        read_pairs(str(folder))
    os.remove(folder / "captions.csv")
    (folder / "captions.jsonl").write_text(
        '{"file": "a.png", "caption": "x y z"}\n{"file": "./a.png", "caption": "w"}\n'
    )
    with pytest.raises(ValueError, match=r"names 'a.png' twice \(lines 1 and 2\)"):
        read_pairs(str(folder))
    (folder / "captions.jsonl").write_text('{"file": "a.png", "caption": "x y z"}\na.png, no json\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object"):
        read_pairs(str(folder))


def test_a_webdataset_tar(tmp_path, vqgan):
    images = {
        "000": noise_image(20, 16, 0),
        "001": noise_image(16, 16, 1),
        "002": noise_image(24, 16, 2),
        "003": noise_image(16, 16, 3),
    }
    members = [
        ("000.jpg", encoded(images["000"], "JPEG")),
        ("000.txt", b"a jpeg with a text caption"),
        ("001.png", encoded(images["001"])),
        ("001.json", json.dumps({"caption": "from json", "NSFW": "UNLIKELY"}).encode()),
        ("002.webp", encoded(images["002"], "WEBP")),
        ("002.json", json.dumps({"text": "a text field"}).encode()),
        ("003.png", encoded(images["003"])),
        ("003.json", json.dumps({"caption": "unsure", "NSFW": "UNSURE"}).encode()),
        ("004.txt", b"a caption without its image"),
        ("004.cls", b"7"),
    ]
    with tarfile.open(tmp_path / "data.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

    report = preprocess(
        str(tmp_path / "data.tar"), str(tmp_path / "shards"), vqgan, rows_per_shard=2, batch_size=2, progress=False
    )
    rows = read_shard_rows(tmp_path / "shards")
    assert [(row["source_id"], row["caption"]) for row in rows] == [
        ("000", "a jpeg with a text caption"),
        ("001", "from json"),
        ("002", "a text field"),
    ]
    stored = dict(members)
    for row, extension in zip(rows, ("jpg", "png", "webp")):  # JPEG and WebP are lossy: decode the same bytes
        image = Image.open(io.BytesIO(stored[f"{row['source_id']}.{extension}"]))
        assert row["codes"] == direct_codes(vqgan, image)
    assert report.dropped == {NSFW: 1, MISSING_IMAGE: 1} and len(report.shards_written) == 2


def test_datasets_in_memory_and_saved_to_disk(tmp_path, vqgan):
    images = [noise_image(16 + i, 16, i) for i in range(3)]
    dataset = datasets.Dataset.from_dict(
        {"image": images, "text": ["one image", "no", "three images"], "NSFW": ["UNLIKELY", "UNLIKELY", None]},
        features=datasets.Features(
            image=datasets.Image(), text=datasets.Value("string"), NSFW=datasets.Value("string")
        ),
    )
    report = preprocess(dataset, str(tmp_path / "from_memory"), vqgan, progress=False)
    assert report.kept == 2 and report.dropped == {SHORT_CAPTION: 1}

    dataset.save_to_disk(str(tmp_path / "saved"))
    pairs = list(read_pairs(str(tmp_path / "saved")))
    # the images come as stored (bytes), not decoded: headers are read only where needed
    assert [(p.source_id, p.caption, p.nsfw) for p in pairs] == [
        ("0", "one image", "UNLIKELY"),
        ("1", "no", "UNLIKELY"),
        ("2", "three images", None),
    ]
    assert all(isinstance(p.image, dict) and p.image["bytes"] for p in pairs)
    preprocess(str(tmp_path / "saved"), str(tmp_path / "from_disk"), vqgan, progress=False)
    assert read_shard_rows(tmp_path / "from_disk") == read_shard_rows(tmp_path / "from_memory")
    assert read_shard_rows(tmp_path / "from_disk")[1]["codes"] == direct_codes(vqgan, images[2])

    with pytest.raises(ValueError, match="no caption column 'title': the columns are image, text, NSFW"):
        read_pairs(dataset, caption_column="title")
    # a name that is neither a local path nor a Hub dataset that can be reached (the tests run offline)
    with pytest.raises(FileNotFoundError, match="no local folder or file 'someone/nothing', and no Hub dataset"):
        read_pairs("someone/nothing")


# ---------------------------------------------------------------------------------------------
# the command line and the Hub


def run_cli(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "collab_kit.cli", "preprocess", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_bad_input_is_a_one_line_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "named").mkdir()
    noise_image(16, 16, 0).save(tmp_path / "named" / "a.png")
    (tmp_path / "named" / "captions.jsonl").write_text(
        '{"file": "a.png", "caption": "here"}\n{"file": "b.png", "caption": "gone"}\n'
    )
    cases = {  # started together: each pays for importing torch
        "no such folder or file": run_cli(str(tmp_path / "missing"), "--output", str(tmp_path / "o1"), "--vqgan", "x"),
        "holds no images (jpg, jpeg, png, webp, bmp)": run_cli(
            str(tmp_path / "empty"), "--output", str(tmp_path / "o2"), "--vqgan", "x"
        ),
        "names 1 image(s) that": run_cli(str(tmp_path / "named"), "--output", str(tmp_path / "o3"), "--vqgan", "x"),
    }
    for message, process in cases.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, stderr
        assert message in stderr and stderr.startswith("collab-kit preprocess: error: ")
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3"))  # nothing written


def test_a_hub_out_of_reach_is_found_before_any_work(tmp_path, vqgan):
    make_captioned_folder(tmp_path / "images", 2)
    # the tests run with HF_HUB_OFFLINE=1 (conftest.py): the Hub cannot be reached
    with pytest.raises(PushError, match="cannot create or reach the Hub dataset someone/codes .*hf auth login"):
        preprocess(
            str(tmp_path / "images"), str(tmp_path / "shards"), vqgan, push_to_hub="someone/codes", progress=False
        )
    assert not (tmp_path / "shards").exists()
    with pytest.raises(ValueError, match="Repo id"):  # huggingface_hub's own check of the name
        preprocess(
            str(tmp_path / "images"), str(tmp_path / "shards"), vqgan, push_to_hub="some one/co des", progress=False
        )


def test_the_cli_pushes_to_the_hub_and_the_shards_stream_back(tmp_path, vqgan, hub_server):
    make_captioned_folder(tmp_path / "images", 7)
    save_vqgan(vqgan, tmp_path / "vqgan")
    command = [
        "preprocess",
        str(tmp_path / "images"),
        "--output",
        str(tmp_path / "shards"),
        "--vqgan",
        str(tmp_path / "vqgan"),
        "--rows-per-shard",
        "3",
        "--push-to-hub",
        "someone/codes",
        "--no-progress",
    ]
    # the real command (python -m collab_kit.cli), twice: the second run skips every shard and uploads nothing new
    stdout = hub_server.run_python(f"""
        import runpy, sys
        for run in range(2):
            sys.argv = ["collab-kit"] + {command!r}
            try:
                runpy.run_module("collab_kit.cli", run_name="__main__")
            except SystemExit as e:
                print(f"exit code: {{e.code}}", flush=True)
    """)
    first, second = stdout.split("exit code: 0\n")[:2]
    assert stdout.count("exit code: 0") == 2
    assert "preprocess: kept 7 of 7 pairs" in first and "3 written (7 images encoded" in first
    assert "0 written" in second and "3 already there" in second
    assert first.strip().endswith("pushed to the Hub dataset someone/codes")
    shards = ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    assert [(c["repo_type"], c["repo_id"], c["added"]) for c in hub_server.commits] == [
        ("dataset", "someone/codes", shards)
    ]  # one commit; the unchanged shards were not sent again
    for name in shards:
        assert (tmp_path / "shards" / name).read_bytes() == open(
            os.path.join(hub_server.folder("someone/codes", "dataset"), name), "rb"
        ).read()

    # what a volunteer does: stream the dataset by its id, through datasets and HfFileSystem
    stdout = hub_server.run_python("""
        import json
        import datasets
        from collab_kit.data.codec import decode_codes
        stream = datasets.load_dataset("someone/codes", streaming=True, split="train")
        for row in stream:
            print(json.dumps(dict(source_id=row["source_id"], caption=row["caption"],
                                  codes=decode_codes(row["codes"]).tolist())))
        # and what a streaming reader does below datasets: list, ask about paths, read parts of a file
        from huggingface_hub import HfApi, HfFileSystem
        import pyarrow.parquet as pq
        fs = HfFileSystem()
        print(json.dumps(dict(found=fs.find("datasets/someone/codes"))))
        with fs.open("datasets/someone/codes/shard-00001.parquet", "rb", block_size=512) as f:
            print(json.dumps(dict(ids=pq.ParquetFile(f).read(columns=["source_id"]).column(0).to_pylist())))
        infos = HfApi().get_paths_info("someone/codes", ["shard-00002.parquet", "nope"], repo_type="dataset")
        print(json.dumps(dict(infos=[(info.path, info.size) for info in infos])))
    """)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    streamed = [line for line in lines if "codes" in line]
    local = [
        dict(source_id=r["source_id"], caption=r["caption"], codes=r["codes"])
        for r in read_shard_rows(tmp_path / "shards")
    ]
    assert streamed == local and len(local) == 7
    found, ids, infos = lines[-3:]
    assert found["found"] == [f"datasets/someone/codes/{name}" for name in shards]
    assert ids["ids"] == [row["source_id"] for row in local[3:6]]
    assert infos["infos"] == [["shard-00002.parquet", os.path.getsize(tmp_path / "shards" / "shard-00002.parquet")]]
    assert any(r.startswith("GET /api/datasets/someone/codes/tree/") for r in hub_server.requests)
    assert any(r.startswith("GET cdn:/lfs/") for r in hub_server.requests)  # parquet comes as LFS, from the "CDN"
    assert any(r.startswith("GET cdn:/lfs/") and " bytes=" in r for r in hub_server.ranges)  # parts of a file
    assert hub_server.unserved == []


def test_a_hub_dataset_is_a_source(tmp_path, vqgan, hub_server):
    # a LAION-like Hub dataset: parquet written by datasets, its images an Image feature (struct of bytes + path)
    images = [noise_image(16 + 2 * i, 16, i) for i in range(4)]
    dataset = datasets.Dataset.from_dict(
        {"image": images, "caption": ["first", "second", "x", "fourth"], "NSFW": ["UNLIKELY", "NSFW", None, None]},
        features=datasets.Features(
            image=datasets.Image(), caption=datasets.Value("string"), NSFW=datasets.Value("string")
        ),
    )
    (tmp_path / "repo" / "data").mkdir(parents=True)
    dataset.to_parquet(str(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet"))
    hub_server.add_repo("someone/laion-sample", str(tmp_path / "repo"), repo_type="dataset")
    save_vqgan(vqgan, tmp_path / "vqgan")

    stdout = hub_server.run_python(f"""
        from collab_kit.data.preprocess import preprocess
        report = preprocess("someone/laion-sample", {str(tmp_path / "shards")!r}, {str(tmp_path / "vqgan")!r},
                            progress=False)
        print(report.summary())
    """)
    assert "kept 2 of 4 pairs (dropped: short_caption 1, nsfw 1)" in stdout
    rows = read_shard_rows(tmp_path / "shards")
    assert [(row["source_id"], row["caption"]) for row in rows] == [("0", "first"), ("3", "fourth")]
    assert [row["codes"] for row in rows] == [direct_codes(vqgan, images[0]), direct_codes(vqgan, images[3])]
    assert hub_server.unserved == []


def test_images_to_shards_to_the_training_stream_give_the_direct_codes(tmp_path, vqgan):
    """The whole path: images -> preprocess -> shards -> ShardStream (as a volunteer reads) -> a direct encode's
    codes."""
    images = make_captioned_folder(tmp_path / "images", 9)
    preprocess(str(tmp_path / "images"), str(tmp_path / "shards"), vqgan, rows_per_shard=4, progress=False)
    tokenizer = ByteCaptionTokenizer()
    stream = iter(
        ShardStream(
            str(tmp_path / "shards"), text_length=24, image_length=16, codebook_size=32, shuffle_buffer=4, seed=1
        )
    )
    streamed = sorted(
        (tokenizer.decode(s["text_tokens"].tolist()), s["image_codes"].tolist())
        for s in (next(stream) for _ in range(9))
    )
    expected = sorted(
        (f"picture number {int(name[3:6])}", direct_codes(vqgan, image)) for name, image in images.items()
    )
    assert streamed == expected


def test_the_training_stream_reads_a_hub_dataset_by_its_id(tmp_path, vqgan, hub_server):
    make_captioned_folder(tmp_path / "images", 7)
    preprocess(str(tmp_path / "images"), str(tmp_path / "shards"), vqgan, rows_per_shard=3, progress=False)
    hub_server.add_repo("someone/codes", str(tmp_path / "shards"), repo_type="dataset")
    stdout = hub_server.run_python("""
        import json
        from collab_kit.data.stream import ShardStream
        stream = ShardStream("someone/codes", text_length=24, image_length=16, codebook_size=32, shuffle_buffer=4)
        samples = iter(stream)
        for _ in range(14):  # two passes
            print(json.dumps(next(samples)["image_codes"].tolist()))
        print(json.dumps(dict(shards=stream.paths, skipped=stream.skipped.total, passes=stream.passes)))
    """)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith(("[", "{"))]
    codes, info = lines[:-1], lines[-1]
    local = sorted(row["codes"] for row in read_shard_rows(tmp_path / "shards"))
    assert sorted(codes[:7]) == local and sorted(codes[7:]) == local
    assert info["shards"] == [f"hf://datasets/someone/codes/shard-0000{i}.parquet" for i in range(3)]
    assert info["skipped"] == 0 and info["passes"] == 2
    assert any(r.startswith("GET cdn:/lfs/") for r in hub_server.requests)
