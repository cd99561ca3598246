"""notebooks/inference.ipynb and collab_kit.images.inference: from a checkpoint (folder or Hub repo) to CLIP's best
pictures.

The checkpoint is an untrained model of the toy world (drawing needs no training to be tested): the toy
VQGAN and toy CLIP shipped with the kit decode and rank what it draws, offline.
"""

import json
from pathlib import Path

import nbformat
import pytest
import torch
from notebook_runs import cell_texts, parameter_names, python3_kernel  # noqa: F401 (python3_kernel: a fixture)
from PIL import Image

from collab_kit.config import get_preset
from collab_kit.images.generate import draw_images
from collab_kit.images.inference import draw_prompts, load_for_inference
from collab_kit.model.checkpoint import save_checkpoint
from collab_kit.model.sampling import TOY_TEMPERATURE, TOY_TOP_K
from collab_kit.model.transformer import TextToImageTransformer

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "inference.ipynb"
PARAMETERS = (
    "CHECKPOINT",
    "REVISION",
    "VQGAN",
    "CLIP",
    "PROMPTS",
    "CANDIDATES",
    "KEEP",
    "TOP_K",
    "TOP_P",
    "TEMPERATURE",
    "SEED",
    "BATCH_SIZE",
    "DEVICE",
    "SHEET_PATH",
    "SUMMARY_PATH",
)
PROMPTS = ["a large red circle in the center", "a small blue square at the top left"]
CANDIDATES, KEEP, SEED = 8, 4, 3


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One torch thread here and in the processes the tests start (the notebook's kernel, the Hub client): the
    models are small, and on a busy machine two threads spinning for each other were 10x slower. Restored after,
    since torch's thread count is global. The same count everywhere also makes results comparable bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory) -> str:
    """An untrained model of the toy preset, saved as the monitor saves checkpoints."""
    config = get_preset("toy")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("toy_checkpoint") / "model"
    return save_checkpoint(TextToImageTransformer(config.model), config, str(folder), metadata=dict(epoch=7))


@pytest.mark.slow  # 13 s alone, 35 s on a busy machine: mostly the kernel starting and importing torch
@pytest.mark.timeout(300)
def test_the_notebook_draws_ranks_and_saves_a_reproducible_grid(toy_checkpoint, tmp_path, python3_kernel):
    import papermill

    sheet_path, summary_path = tmp_path / "sheet.png", tmp_path / "summary.json"
    parameters = dict(
        CHECKPOINT=toy_checkpoint,
        PROMPTS=PROMPTS,
        CANDIDATES=CANDIDATES,
        KEEP=KEEP,
        SEED=SEED,
        DEVICE="cpu",
        SHEET_PATH=str(sheet_path),
        SUMMARY_PATH=str(summary_path),
    )
    assert set(parameters) <= set(PARAMETERS) <= parameter_names(nbformat.read(str(NOTEBOOK), as_version=4))
    output_path = tmp_path / "inference.out.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(output_path),
        parameters=parameters,
        kernel_name=python3_kernel,
        cwd=str(tmp_path),
        progress_bar=False,
        start_timeout=120,
        execution_timeout=180,
    )

    # the grid: one row per prompt of KEEP pictures of 64 px, enlarged twice, below a title band of 22 px
    summary = json.loads(summary_path.read_text())
    sheet = Image.open(sheet_path)
    assert sheet.size == (KEEP * 64 * 2, len(PROMPTS) * (22 + 64 * 2 + 6))
    assert summary["sheet_size"] == list(sheet.size) and summary["sheet_path"] == str(sheet_path)
    assert summary["prompts"] == PROMPTS and summary["scale"] == 2 and summary["top_k"] == TOY_TOP_K
    assert summary["temperature"] == TOY_TEMPERATURE  # "auto" for the toy world
    executed = nbformat.read(str(output_path), as_version=4)
    assert any("image/png" in output.get("data", {}) for cell in executed.cells for output in cell.get("outputs", []))
    text = cell_texts(executed)
    assert "preset toy" in text and "epoch 7" in text and f"all {CANDIDATES}: best" in text

    # the kept scores are the best KEEP of the candidates' scores, best first ...
    pieces = load_for_inference(toy_checkpoint, device="cpu")
    for index, (prompt, row) in enumerate(zip(PROMPTS, summary["per_prompt"])):
        assert row["prompt"] == prompt and row["seed"] == SEED + index
        assert len(row["candidate_scores"]) == CANDIDATES
        assert row["kept_scores"] == sorted(row["kept_scores"], reverse=True)
        assert row["kept_scores"] == sorted(row["candidate_scores"], reverse=True)[:KEEP]
        # ... and the candidates' scores are CLIP's for the pictures this seed draws, computed here anew
        drawn = draw_images(
            prompt,
            CANDIDATES,
            model=pieces.model,
            vqgan=pieces.vqgan,
            tokenizer=pieces.tokenizer,
            top_k=TOY_TOP_K,
            temperature=TOY_TEMPERATURE,
            seed=SEED + index,
            progress=False,
        )
        assert row["candidate_scores"] == pytest.approx(pieces.ranker.score(prompt, drawn).tolist(), abs=1e-5)
    assert len({score for row in summary["per_prompt"] for score in row["candidate_scores"]}) > CANDIDATES

    # the same seed draws the same sheet in this process as in the notebook's kernel; another seed does not
    again = draw_prompts(pieces, PROMPTS, n=CANDIDATES, keep=KEEP, seed=SEED, progress=False)
    assert again.sheet.tobytes() == sheet.convert("RGB").tobytes()
    other = draw_prompts(pieces, PROMPTS, n=CANDIDATES, keep=KEEP, seed=SEED + 100, progress=False)
    assert other.sheet.tobytes() != again.sheet.tobytes()


def test_bad_settings_say_what_to_pass(toy_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="no checkpoint given.*demo_out/model.*Hub model repository id"):
        load_for_inference("")
    with pytest.raises(
        FileNotFoundError,
        match=r"(?s)no checkpoint at .*nowhere.*Pass CHECKPOINT = a checkpoint "
        r"folder holding model.safetensors and config.json",
    ):
        load_for_inference(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors, config.json missing"):
        load_for_inference(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is not a device: use 'auto', 'cpu'"):
        load_for_inference(toy_checkpoint, device="nonsense")

    pieces = load_for_inference(toy_checkpoint, device="cpu")
    for settings, message in (
        (dict(n=4, keep=5), "KEEP=5"),
        (dict(top_k=0), "TOP_K=0"),
        (dict(top_p=1.5), "TOP_P"),
        (dict(temperature=-1.0), "TEMPERATURE=-1.0"),
        (dict(temperature="hot"), "TEMPERATURE='hot'"),
        (dict(prompts=[""]), "PROMPTS"),
    ):
        arguments = dict(dict(prompts=PROMPTS[:1], n=2, keep=1, progress=False), **settings)
        with pytest.raises(ValueError, match=message):
            draw_prompts(pieces, arguments.pop("prompts"), **arguments)


def test_a_run_outside_the_toy_world_needs_its_own_vqgan_and_clip(tmp_path):
    # the paper's codes (8192 of them) need the VQGAN that encoded the data: no default can stand in for it
    paper_codes = get_preset("tiny", model=dict(codebook_size=8192))
    folder = save_checkpoint(TextToImageTransformer(paper_codes.model), paper_codes, str(tmp_path / "paper_codes"))
    with pytest.raises(ValueError, match="pass VQGAN .* vqgan_gumbel_f8"):
        load_for_inference(folder, device="cpu")
    # the tiny preset's synthetic codes: an untrained VQGAN draws them; CLIP is OpenAI's, from the Hub (offline here)
    tiny = get_preset("tiny")
    folder = save_checkpoint(TextToImageTransformer(tiny.model), tiny, str(tmp_path / "tiny"))
    with pytest.raises(OSError, match="could not load CLIP from 'openai/clip-vit-base-patch32'"):
        load_for_inference(folder, device="cpu")
    pieces = load_for_inference(folder, clip="none", device="cpu")
    assert pieces.ranker is None and pieces.suggested_top_k == tiny.model.codebook_size
    assert pieces.suggested_temperature == 1.0  # the toy world's lower temperature is for its briefly trained model
    result = draw_prompts(pieces, ["a red cross on blue"], n=3, keep=2, seed=0, progress=False)
    row = result.summary()["per_prompt"][0]
    assert row["kept_scores"] is None and row["candidate_scores"] is None and not result.summary()["ranked"]
    assert result.sheet.size[1] == 22 + 16 * 8 + 6  # 16 px pictures enlarged 8 times
    assert "not ranked" in result.score_lines()[0]


def test_a_checkpoint_loads_by_hub_repository_id(toy_checkpoint, tmp_path, hub_server):
    """The real huggingface_hub client, in a fresh process, loads the pieces from the stand-in Hub and draws."""
    commit = hub_server.add_repo("someone/toy-run", toy_checkpoint)
    sheet_path = tmp_path / "hub_sheet.png"
    stdout = hub_server.run_python(f"""
        import json
        from collab_kit.images.inference import draw_prompts, load_for_inference
        pieces = load_for_inference("someone/toy-run", revision={commit!r}, device="cpu")
        result = draw_prompts(pieces, {PROMPTS[:1]!r}, n=3, keep=2, seed=5, progress=False)
        result.save_sheet({str(sheet_path)!r})
        try:
            load_for_inference("someone/no-such-run")
            error = ""
        except FileNotFoundError as e:
            error = str(e)
        print(json.dumps(dict(line=pieces.describe(), toy=pieces.toy_world, summary=result.summary(), error=error)))
    """)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["toy"] and report["line"].startswith(f"someone/toy-run@{commit}: preset toy")
    assert report["summary"]["checkpoint"] == "someone/toy-run" and report["summary"]["revision"] == commit
    assert "the Hub has no model repository 'someone/no-such-run'" in report["error"]
    assert "Pass CHECKPOINT =" in report["error"]
    assert f"HEAD /someone/toy-run/resolve/{commit}/model.safetensors" in hub_server.requests
    # the same weights as the folder: the same seed draws the same sheet from either
    local = draw_prompts(
        load_for_inference(toy_checkpoint, device="cpu"), PROMPTS[:1], n=3, keep=2, seed=5, progress=False
    )
    assert Image.open(sheet_path).convert("RGB").tobytes() == local.sheet.tobytes()
    assert report["summary"]["per_prompt"] == local.summary()["per_prompt"]
