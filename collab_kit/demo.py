"""``make demo``: a whole collaborative run on this machine, on the toy world, and what it learned.

A first peer (the coordinator) and N volunteers start as separate processes on 127.0.0.1; the
volunteers train the ``toy`` preset together for E global epochs on the toy world's dataset (shapes
drawn by collab_kit.data.synthetic, encoded by the shipped toy VQGAN through ``preprocess`` once, then cached).
Then the trained model draws pictures for a fixed set of prompts through ``generate_images`` (toy
VQGAN decode, toy CLIP rerank) and the demo writes, in ``demo_out/``:

- ``samples.png``: for each prompt, CLIP's best pictures of the ones drawn, below the prompt, each with what it
  was scored on (colour, shape, place, size: green where it shows what the prompt asks, red where it does not);
- ``loss.png``: each volunteer's loss per global epoch;
- ``model/``: the trained model as a checkpoint (``generate_images(model="demo_out/model", ...)``).

It finishes with one summary line. ``color_match``, ``shape_match``, ``place_match`` and ``size_match`` are the
shares of the kept pictures that show the colour, shape, place and size the prompt asks for, read from the pixels
with no model (collab_kit.data.scene_scores; chance: 0.125, 0.2, 0.2 and 0.5):

    demo: peers=2 epochs=300 loss_first=5.5960 loss_last=0.5192 averaged_rounds=298 bytes_sent=777.51MiB
    color_match=1.000 shape_match=0.812 place_match=1.000 size_match=1.000   (one line)

``bytes_sent`` is what a volunteer sent to the other peers over the run (the mean over volunteers): its averaging
rounds, and the states it served (the monitor's checkpoints download them). ``collab-kit demo --local-steps H`` runs
the local-update mode (collab_kit.swarm.local_updates) instead, and its line ends with ``local_steps=H``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

from collab_kit.config import get_preset, parse_overrides
from collab_kit.data.preprocess import preprocess
from collab_kit.data.scene_scores import CHANCE, picture_marks, scene_scores
from collab_kit.data.synthetic import make_synthetic_images
from collab_kit.errors import CollabKitError
from collab_kit.images.inference import draw_prompts, load_for_inference
from collab_kit.model.vqgan import untrained_vqgan
from collab_kit.roles.monitor_settings import MonitorSettings
from collab_kit.roles.processes import PeerProcess
from collab_kit.roles.services import Service, ServiceError, start_monitor, start_volunteer_process
from collab_kit.toy.dataset import prepare_toy_dataset
from collab_kit.widgets.dashboard import write_page

logger = logging.getLogger(__name__)

# one prompt per colour, with every shape, both sizes and several places: what samples.png shows
DEMO_PROMPTS = (
    "a large red circle in the center",
    "a large orange square at the top left",
    "a large yellow triangle in the center",
    "a large green diamond at the bottom right",
    "a small cyan cross in the center",
    "a large blue circle at the top right",
    "a large purple square at the bottom left",
    "a small pink triangle in the center",
)


@dataclasses.dataclass
class DemoResult:
    peers: int
    epochs: int
    loss_first: float  # mean loss of the volunteers' local steps in the first global epoch
    loss_last: float  # ... in the last one
    averaged_rounds: int  # global steps every volunteer averaged with others (the minimum over volunteers)
    seconds: float
    bytes_sent: float = 0.0  # bytes a volunteer sent to the others over the run (the mean over volunteers)
    bytes_served: float = 0.0  # ... of which the states it served (the monitor's checkpoints download them)
    local_steps: int = 0  # the local-update mode's H (collab_kit.swarm.local_updates); 0: synchronous
    color_match: float | None = None  # share of the kept toy pictures in the prompt's colour (toy preset only)
    shape_match: float | None = None  # ... of the prompt's shape
    place_match: float | None = None  # ... at the prompt's place
    size_match: float | None = None  # ... of the prompt's size
    # the mean loss of the volunteers' local steps in each global epoch every volunteer completed: epoch -> loss
    epoch_losses: dict[int, float] = dataclasses.field(default_factory=dict)
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # what was written: name -> path

    def summary_line(self) -> str:
        line = (
            f"demo: peers={self.peers} epochs={self.epochs} loss_first={self.loss_first:.4f} "
            f"loss_last={self.loss_last:.4f} averaged_rounds={self.averaged_rounds} "
            f"bytes_sent={self.bytes_sent / 2**20:.2f}MiB"
        )
        if self.local_steps:
            line += f" local_steps={self.local_steps}"
        for aspect in ("color", "shape", "place", "size"):
            if (score := getattr(self, f"{aspect}_match")) is not None:
                line += f" {aspect}_match={score:.3f}"
        return line


def prepare_demo_data(workdir: str, num_samples: int, config) -> str:
    """The demo's data, made as a real run's is: pictures -> ``preprocess`` (VQGAN codes) -> shards.

    The ``toy`` preset reads the toy world's dataset (collab_kit.toy.dataset.prepare_toy_dataset: made once,
    then taken from the cache). Other presets get synthetic pictures ("a red cross on blue") encoded
    by an untrained VQGAN of their code grid, in ``workdir``. Returns the shards' folder.
    """

    started = time.monotonic()
    if config.data.tokenizer == "toy":
        shards = prepare_toy_dataset(num_samples, progress=True)
        print(
            f"demo: the toy world's dataset ({num_samples} pictures as toy VQGAN codes) in {shards} "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
        return shards
    vqgan = untrained_vqgan(config.model.image_side, config.model.codebook_size)
    images = make_synthetic_images(os.path.join(workdir, "pictures"), num_samples, size=vqgan.image_size)
    report = preprocess(
        images,
        os.path.join(workdir, "shards"),
        vqgan,
        rows_per_shard=max(1, num_samples // 8),
        batch_size=256,
        progress=False,
    )
    print(
        f"demo: {report.kept} synthetic pictures -> VQGAN codes in {len(report.shards)} shards "
        f"({report.bytes_total / 1024:.0f} KiB, {time.monotonic() - started:.0f} s)",
        flush=True,
    )
    return report.output


class DemoFailed(CollabKitError, RuntimeError):
    """The demo could not show a collaborative run; the message says which part failed."""


# global batches the demo trains by default (5 for other presets): all of the toy preset's schedule
DEFAULT_EPOCHS = {"toy": get_preset("toy").optimizer.total_steps}
# The local-update mode waits for the network once a round, not at every global batch, so the same minutes hold nearly
# four times the global batches. A round of H = 10 is 5 steps a peer: their pseudo-gradient is close to 5 averaged
# steps, so the outer step only averages (lr 1, no momentum); DiLoCo's Nesterov 0.7 / 0.9, made for hundreds of inner
# steps, scales it up to 7-fold: shape_match 0.34 at an inner rate of 1e-2, and 3e-2 diverged. The demo's schedule in
# that mode, where the command line sets none of it.
LOCAL_UPDATE_SCHEDULE = {"toy": dict(total_steps=900, outer_learning_rate=1.0, outer_momentum=0.0)}


def default_epochs(preset: str, epoch_batches: int = 1, local_updates: bool = False) -> int:
    """Global epochs the demo trains by default: the preset's global batches (``DEFAULT_EPOCHS``, or in local-update
    mode ``LOCAL_UPDATE_SCHEDULE``'s), which in local-update mode come ``epoch_batches`` to an epoch (H, or H / F with
    fragments; rounded up)."""
    batches = DEFAULT_EPOCHS.get(preset, 5)
    if local_updates:
        batches = int(LOCAL_UPDATE_SCHEDULE.get(preset, {}).get("total_steps", batches))
    return -(-batches // max(1, epoch_batches))


def demo_overrides(preset: str, overrides: Sequence[str]) -> list[str]:
    """``overrides`` with, in local-update mode, the demo's schedule for it (``LOCAL_UPDATE_SCHEDULE``) where they
    do not set those fields themselves."""
    chosen = parse_overrides(overrides)
    if not get_preset(preset, **chosen).optimizer.local_updates:
        return list(overrides)
    own = chosen.get("optimizer", {})
    schedule = LOCAL_UPDATE_SCHEDULE.get(preset, {})
    return [*overrides, *(f"optimizer.{name}={value!r}" for name, value in schedule.items() if name not in own)]


def run_demo(
    num_volunteers: int = 2,
    epochs: int | None = None,
    preset: str = "toy",
    workdir: str | None = None,
    timeout: float | None = None,
    num_samples: int | None = None,
    keep_workdir: bool = False,
    output_dir: str | None = "demo_out",
    overrides: Sequence[str] = (),
    prompts: Sequence[str] = DEMO_PROMPTS,
    draws_per_prompt: int = 32,
    keep: int = 4,
) -> DemoResult:
    """Start a coordinator and ``num_volunteers`` volunteers on 127.0.0.1, train, then show what was learned.

    :param num_volunteers: training peers (each its own process)
    :param epochs: global epochs to train (default: 300 for the toy preset, its whole schedule; 5 for the others; in
      local-update mode, with ``optimizer.local_steps=H`` among ``overrides``, rounds of H global batches: as many as
      hold those global batches, see ``default_epochs``)
    :param preset: the configuration preset (``toy``: the toy world, with samples and color_match at the end)
    :param workdir: where the peers' logs (and a non-toy dataset) go (default: a temporary folder, removed on
      success)
    :param timeout: seconds the training may take before the demo gives up (default: 720 toy, 270 others)
    :param num_samples: pictures in the dataset (default: 2048 for the toy world, whose 1200 scenes its 300 steps of 32
      read about 5 times over, made in half the time of 4096; 4096 for the others)
    :param keep_workdir: keep the logs even after a successful run
    :param output_dir: where loss.png (and for the toy preset samples.png and the model) are written;
      None writes nothing
    :param overrides: ``SECTION.FIELD=VALUE`` changes to the preset, given to every peer (as ``--set``)
    :param prompts: what the trained toy model draws
    :param draws_per_prompt: pictures drawn per prompt, of which CLIP keeps ``keep``
    :raises DemoFailed: with what went wrong and where the logs are
    """
    config = get_preset(preset, **parse_overrides(demo_overrides(preset, overrides)))
    if epochs is None:
        epochs = default_epochs(preset, config.optimizer.epoch_batches, config.optimizer.local_updates)
    if num_volunteers < 1 or epochs < 1:
        raise ValueError(
            f"the demo needs at least one volunteer and one epoch (got peers={num_volunteers}, epochs={epochs})"
        )
    timeout = timeout if timeout is not None else (720.0 if preset == "toy" else 270.0)
    # every peer on this machine, in one run of its own
    config = dataclasses.replace(
        config, swarm=dataclasses.replace(config.swarm, host="127.0.0.1", run_id=f"demo_{os.getpid()}")
    )
    toy_world = config.data.tokenizer == "toy"
    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="collab_kit_demo_")
    os.makedirs(workdir, exist_ok=True)
    if output_dir is not None:
        os.makedirs(output_dir, exist_ok=True)
    if num_samples is None:
        num_samples = 2048 if toy_world else 4096
    shards = prepare_demo_data(workdir, num_samples, config)
    # the run's data: the monitor publishes it with the run's settings, and the volunteers check theirs against it
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, shards=shards))
    started = time.monotonic()
    deadline = started + timeout
    checkpoint = os.path.join(output_dir if output_dir is not None else workdir, "model") if toy_world else None
    # the first peer is the run's monitor: its history (loss, peers, throughput, leaderboard) and the swarm's
    # checkpoints go beside the other outputs, and the dashboard page is drawn from that history at the end
    monitor_settings = _fresh_monitor_settings(output_dir if output_dir is not None else workdir, workdir, epochs)

    services: list[Service] = []
    succeeded = False
    try:
        print(
            f"demo: starting the first peer and {num_volunteers} volunteers on 127.0.0.1 "
            f"(preset {preset}, logs in {workdir})",
            flush=True,
        )
        services = _start_peers(config, monitor_settings, num_volunteers, epochs, shards, checkpoint, workdir, deadline)
        volunteers = [service.process for service in services[1:]]
        print(f"demo: {num_volunteers} volunteers joined; training {epochs} global epochs", flush=True)
        losses, finished = _follow_training(volunteers, epochs, deadline, timeout, workdir)
        result = _result(losses, finished, num_volunteers, time.monotonic() - started, workdir)
        result.local_steps = config.optimizer.local_steps
        for service in reversed(services):  # the swarm's work is done: free the cores for drawing
            service.stop(grace=5.0)
        if output_dir is not None:
            result.outputs["loss"] = plot_losses(losses, os.path.join(output_dir, "loss.png"))
            result.outputs["dashboard"] = write_dashboard(
                monitor_settings.db_path, os.path.join(output_dir, "dashboard.html")
            )
        if toy_world:
            _draw_from_checkpoint(
                result, checkpoint, output_dir, prompts, draws_per_prompt, keep, volunteers[0].log_path
            )
        for name, path in result.outputs.items():
            print(f"demo: wrote {name}: {path}", flush=True)
        succeeded = True
        return result
    finally:
        for service in reversed(services):
            service.stop(grace=5.0)
        if succeeded and own_workdir and not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _fresh_monitor_settings(folder: str, workdir: str, epochs: int) -> MonitorSettings:
    """The demo's monitor: a new history and checkpoint series in ``folder`` (a new run gets a new history), its
    join addresses also in ``workdir``, a checkpoint every third of the run, a poll every 2 s."""
    monitor_db = os.path.join(folder, "monitor.sqlite")
    for stale in (monitor_db, monitor_db + "-wal", monitor_db + "-shm"):
        if os.path.exists(stale):
            os.remove(stale)
    checkpoints = os.path.join(folder, "checkpoints")
    shutil.rmtree(checkpoints, ignore_errors=True)
    return MonitorSettings(
        db_path=monitor_db,
        checkpoint_dir=checkpoints,
        checkpoint_every=max(1, epochs // 3),
        keep_last=2,
        poll_every=2.0,
        address_file=os.path.join(workdir, "first_peer.addr"),
    )


def _start_peers(
    config,
    monitor_settings: MonitorSettings,
    num_volunteers: int,
    epochs: int,
    shards: str,
    checkpoint: str | None,
    workdir: str,
    deadline: float,
) -> list[Service]:
    """The first peer, then the volunteers (all started at once, then waited for), through collab_kit.roles.services
    as a maintainer's would be, with the command lines it builds from the configuration. Returns them, first peer
    first; on a failure, stops what started and says which part failed."""
    services: list[Service] = []
    try:
        try:
            services.append(
                start_monitor(config, monitor_settings, log_path=os.path.join(workdir, "first_peer.log"), timeout=60)
            )
        except ServiceError as e:
            raise DemoFailed(f"the first peer did not start: {e}") from None
        volunteer_config = dataclasses.replace(
            config, swarm=dataclasses.replace(config.swarm, initial_peers=tuple(services[0].addresses))
        )
        threads = max(1, (os.cpu_count() or 2) // num_volunteers)
        for index in range(num_volunteers):
            services.append(
                start_volunteer_process(
                    volunteer_config,
                    data_shards=shards,
                    max_epochs=epochs,
                    wait_for_peers=num_volunteers,
                    threads=threads,
                    name=f"volunteer {index + 1}",
                    log_path=os.path.join(workdir, f"volunteer_{index + 1}.log"),
                    save_checkpoint=checkpoint if index == 0 else None,
                    wait=False,
                )
            )
        for service in services[1:]:
            try:
                service.wait_until_ready(timeout=max(1.0, deadline - time.monotonic()))
            except ServiceError as e:
                raise DemoFailed(f"a volunteer could not join the first peer: {e}") from None
    except BaseException:
        for service in reversed(services):
            service.stop(grace=5.0)
        raise
    return services


def _follow_training(
    volunteers: list[PeerProcess], epochs: int, deadline: float, timeout: float, workdir: str
) -> tuple[dict[int, dict[str, float]], dict[str, dict]]:
    """Show each volunteer's epochs as they end, until every one says it is done; returns (each global epoch's loss by
    volunteer, each volunteer's "done" event). A volunteer that stops early or a run past ``deadline`` fails the
    demo, with where to look."""
    losses: dict[int, dict[str, float]] = defaultdict(dict)
    finished: dict[str, dict] = {}
    while len(finished) < len(volunteers):
        if time.monotonic() > deadline:
            raise DemoFailed(f"the run did not finish within {timeout:.0f} s; logs in {workdir}")
        for volunteer in volunteers:
            exited = volunteer.process.poll() is not None  # before reading, so no last event is missed
            for event in volunteer.new_events(timeout=0.2):
                if event["type"] == "done":
                    finished[volunteer.name] = event
                elif event["type"] == "epoch":
                    _show_epoch(losses, event, volunteer.name, len(volunteers), epochs)
            if exited and volunteer.name not in finished:
                raise DemoFailed(
                    f"{volunteer.name} stopped before the end (exit code "
                    f"{volunteer.process.returncode}); last lines of {volunteer.log_path}:\n"
                    f"{volunteer.log_tail()}"
                )
    for volunteer in volunteers:
        code = volunteer.wait_exit(timeout=max(5.0, deadline - time.monotonic()))
        if code != 0:
            raise DemoFailed(f"{volunteer.name} exited with code {code}; see {volunteer.log_path}")
    return losses, finished


def _result(
    losses: dict[int, dict[str, float]], finished: dict[str, dict], num_volunteers: int, seconds: float, workdir: str
) -> DemoResult:
    """What the run showed: the loss of the first and last global epochs every volunteer completed, and how many
    rounds they averaged; a run in which they never averaged is no collaborative run, and fails the demo."""
    complete = [epoch for epoch in sorted(losses) if len(losses[epoch]) == num_volunteers]
    if not complete:
        raise DemoFailed(f"no global epoch was completed by every volunteer; logs in {workdir}")
    averaged_rounds = min(event["averaged_rounds"] for event in finished.values())
    first_epoch, last_epoch = complete[0], complete[-1]
    result = DemoResult(
        peers=num_volunteers,
        epochs=max(event["final_epoch"] for event in finished.values()),
        loss_first=sum(losses[first_epoch].values()) / num_volunteers,
        loss_last=sum(losses[last_epoch].values()) / num_volunteers,
        averaged_rounds=averaged_rounds,
        seconds=seconds,
        bytes_sent=sum(event.get("bytes_sent", 0) for event in finished.values()) / len(finished),
        bytes_served=sum(event.get("bytes_served", 0) for event in finished.values()) / len(finished),
        epoch_losses={epoch: sum(losses[epoch].values()) / num_volunteers for epoch in complete},
    )
    if num_volunteers > 1 and averaged_rounds == 0:
        raise DemoFailed(
            f"the volunteers trained but never averaged gradients with each other: they did not "
            f"meet in the swarm. Logs in {workdir}"
        )
    return result


def _draw_from_checkpoint(
    result: DemoResult,
    checkpoint: str,
    output_dir: str | None,
    prompts: Sequence[str],
    draws_per_prompt: int,
    keep: int,
    log_path: str,
) -> None:
    """The toy world's end: the checkpoint volunteer 1 saved draws the prompts (samples.png) and is scored."""
    if not os.path.exists(os.path.join(checkpoint, "model.safetensors")):
        raise DemoFailed(f"volunteer 1 finished but left no checkpoint in {checkpoint}; see {log_path}")
    result.outputs["model"] = checkpoint
    samples = os.path.join(output_dir, "samples.png") if output_dir is not None else None
    scores = draw_toy_samples(checkpoint, prompts, samples, n=draws_per_prompt, keep=keep)
    for aspect, score in scores.items():
        setattr(result, f"{aspect}_match", score)
    if samples is not None:
        result.outputs["samples"] = samples


def write_dashboard(monitor_db: str, path: str) -> str:
    """The dashboard page (collab_kit.widgets.dashboard) of what the demo's monitor recorded."""

    if not os.path.exists(monitor_db):
        raise DemoFailed(f"the first peer wrote no history to {monitor_db}: see its log")
    return write_page(monitor_db, path, title="collab_kit demo", loss_x="epoch")


def draw_toy_samples(
    checkpoint: str,
    prompts: Sequence[str],
    path: str | None,
    n: int = 32,
    keep: int = 4,
    seed: int = 0,
    top_k: int | None = None,
) -> dict[str, float]:
    """Draw ``n`` pictures per prompt with a toy-world model, keep CLIP's best ``keep``, save them as a scored sheet.

    The same path as ``notebooks/inference.ipynb`` (``collab_kit.images.inference``): the shipped toy VQGAN and
    toy CLIP, the toy world's top-k; the same checkpoint and seed give the same pictures.

    :param checkpoint: a checkpoint folder (or Hub id) of a model trained on the toy world
    :param path: where to save the sheet (``scored_sheet``); None saves nothing
    :param top_k: None: the toy world's (``collab_kit.model.sampling.TOY_TOP_K``)
    :returns: the kept pictures' shares that show the prompt's color, shape, place and size
      (collab_kit.data.scene_scores.scene_scores)
    """

    pieces = load_for_inference(checkpoint, device="cpu")
    result = draw_prompts(pieces, prompts, n=n, keep=keep, seed=seed, top_k="auto" if top_k is None else top_k)
    kept = [image for grid in result.grids for image in grid.info["images"]]
    wanted = [grid.info["prompt"] for grid in result.grids for _ in grid.info["images"]]
    scores = scene_scores(kept, wanted)
    if path is not None:
        rows = [grid.info["images"] for grid in result.grids]
        scored_sheet(rows, [grid.info["prompt"] for grid in result.grids], scores).save(path, format="PNG")
    return scores


ASPECT_WORDS = {"color": "colour", "shape": "shape", "place": "place", "size": "size"}
MATCH, MISS, NOT_ASKED = (30, 140, 60), (200, 40, 40), (170, 170, 170)


def scored_sheet(rows: Sequence[Sequence], prompts: Sequence[str], scores: dict[str, float], scale: int = 2):
    """Each prompt above its pictures, and under each picture the aspects it was scored on: green where it shows
    what the prompt asks, red where it does not; the scores and their chance levels at the bottom."""
    title_font, mark_font = ImageFont.load_default(size=14), ImageFont.load_default(size=11)
    tile = max(row[0].width for row in rows) * scale
    width = max(max(len(row) for row in rows) * tile, max(int(title_font.getlength(p)) for p in prompts) + 8)
    legend = ", ".join(
        f"{ASPECT_WORDS[aspect]} {score:.2f} (chance {CHANCE[aspect]:.2f})" for aspect, score in scores.items()
    )
    width = max(width, int(mark_font.getlength(legend)) + 8)
    row_height = 22 + tile + 16 + 6
    sheet = Image.new("RGB", (width, len(rows) * row_height + 20), "white")
    pen = ImageDraw.Draw(sheet)
    for index, (row, prompt) in enumerate(zip(rows, prompts)):
        top = index * row_height
        pen.text((4, top + 3), prompt, fill="black", font=title_font)
        for column, picture in enumerate(row):
            sheet.paste(picture.resize((tile, tile), Image.NEAREST), (column * tile, top + 22))
            marks, x = picture_marks(picture, prompt), column * tile + 3
            for aspect, word in ASPECT_WORDS.items():
                color = NOT_ASKED if aspect not in marks else MATCH if marks[aspect] else MISS
                pen.text((x, top + 22 + tile + 2), word, fill=color, font=mark_font)
                x += int(mark_font.getlength(word + " "))
    pen.text((4, len(rows) * row_height + 3), legend, fill="black", font=mark_font)
    return sheet


def plot_losses(losses: dict[int, dict[str, float]], path: str) -> str:
    """Each volunteer's mean loss per global epoch, and their mean, as a PNG."""
    # lazy: matplotlib takes a second to import; only a plot needs it
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib takes a second to import; only a plot needs it
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(7, 4))
    names = sorted({name for per_peer in losses.values() for name in per_peer})
    for name in names:
        epochs = [epoch for epoch in sorted(losses) if name in losses[epoch]]
        ax.plot([e + 1 for e in epochs], [losses[e][name] for e in epochs], alpha=0.6, linewidth=1, label=name)
    complete = [epoch for epoch in sorted(losses) if len(losses[epoch]) == len(names)]
    ax.plot(
        [e + 1 for e in complete],
        [sum(losses[e].values()) / len(names) for e in complete],
        color="black",
        linewidth=2,
        label="mean",
    )
    ax.set_xlabel("global epoch (one averaged step of the swarm)")
    ax.set_ylabel("training loss")
    ax.set_title(f"{len(names)} volunteers training together")
    ax.grid(alpha=0.3)
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _show_epoch(losses: dict[int, dict[str, float]], event: dict, name: str, num_volunteers: int, epochs: int):
    """Record one volunteer's epoch; once every volunteer has reported it, print the epoch's line."""
    epoch = event["epoch"]
    losses[epoch][name] = event["loss"]
    if len(losses[epoch]) < num_volunteers:
        return
    mean = sum(losses[epoch].values()) / num_volunteers
    per_peer = ", ".join(f"{peer}: {loss:.3f}" for peer, loss in sorted(losses[epoch].items()))
    together = f"averaged across {event['group_size']} peers" if event["averaged"] else "not averaged"
    print(f"demo: epoch {epoch + 1}/{epochs} loss {mean:.4f} ({per_peer}); {together}", flush=True)
