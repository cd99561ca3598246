"""Configuration: one dataclass per concern (model, optimizer, swarm, data) and named presets.

Every field is checked when the dataclass is built, so a wrong value fails at once with a
ValueError that names the field and what is allowed, instead of deep inside torch or hivemind.

Presets:
- ``tiny``: unit and multi-process tests; a training step takes milliseconds on one CPU core.
- ``small``: a CPU run on synthetic codes; several peers share two cores and still learn visibly.
- ``toy``: the toy world (the pictures of collab_kit.data.synthetic): its word captions, its VQGAN's 8x8 codes of 512;
what ``make demo`` trains.
- ``paper``: the values of the paper's run (section 3 of "Training Transformers Together").
"""

from __future__ import annotations

import ast
import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from collab_kit.addresses import all_on_this_machine, parse_initial_peers
from collab_kit.errors import CollabKitError

PRESETS = ("tiny", "small", "toy", "paper")


class SettingProblem(CollabKitError, ValueError):
    """A problem the reader fixes by changing a setting: the message says what is wrong and which setting to change."""


class SettingFileMissing(SettingProblem, FileNotFoundError):
    """A file or folder a setting names is not there: shown as one sentence, caught as FileNotFoundError too."""


def _require(condition: bool, field_name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise SettingProblem(f"{field_name}={value!r} is not allowed: {allowed}")


def _positive_int(owner: str, name: str, value: Any) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        f"{owner}.{name}",
        "expected a positive integer",
        value,
    )


def _positive_float(owner: str, name: str, value: Any) -> None:
    _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
        f"{owner}.{name}",
        "expected a positive number",
        value,
    )


ATTENTION_KINDS = ("row", "column", "conv", "full")


@dataclass
class ModelConfig:
    """Shape of the decoder-only text-to-image transformer (section 3.1 of the paper).

    A sample is ``[caption tokens (text_length); image codes (image_side ** 2)]``; the model predicts
    every next token of both parts. Layer ``i`` attends with ``attention_pattern[i % 4]`` (row, column,
    row, row) and the last layer with ``last_layer_attention`` (conv); with ``share_layer_groups`` the
    layers that play the same part of the pattern are one block, so 64 layers store 5 blocks.
    """

    hidden_size: int = 1024
    num_layers: int = 64
    num_heads: int = 16
    text_length: int = 256  # caption tokens, padded or cut to this length
    image_side: int = 32  # the image is image_side x image_side VQGAN codes
    codebook_size: int = 8192  # VQGAN codes
    text_vocab_size: int = 32100  # t5-small in the paper
    pad_token_id: int = 1  # pad = eos, as in the original run's T5 tokenizer
    ffn_multiplier: int = 4  # GEGLU inner width = ffn_multiplier * hidden_size
    # what each layer sees (collab_kit.model.attention): "row", "column", "conv" (a window of
    # conv_kernel_size x conv_kernel_size codes) or "full" (every earlier position)
    attention_pattern: tuple[str, ...] = ("row", "column", "row", "row")
    last_layer_attention: str | None = "conv"  # None: the last layer follows the pattern too
    conv_kernel_size: int = 11  # DALL-E's convolutional mask is 11 x 11
    share_layer_groups: bool = True  # one block per part of the pattern (ALBERT-style sharing)
    reversible: bool = True  # recompute activations in backward: memory does not grow with depth

    def __post_init__(self):
        if isinstance(self.attention_pattern, str):  # "row,column,row,row" from the command line
            self.attention_pattern = tuple(kind.strip() for kind in self.attention_pattern.split(","))
        self.attention_pattern = tuple(self.attention_pattern)
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "text_length",
            "image_side",
            "codebook_size",
            "text_vocab_size",
            "ffn_multiplier",
            "conv_kernel_size",
        ):
            _positive_int("model", name, getattr(self, name))
        _require(
            self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            f"must be divisible by model.num_heads={self.num_heads}",
            self.hidden_size,
        )
        # rotary embeddings turn half of each head by the row and half by the column: pairs of pairs
        _require(
            self.head_size % 4 == 0,
            "model.hidden_size",
            f"hidden_size / num_heads = {self.head_size} must be a multiple of 4 (2D rotary embeddings)",
            self.hidden_size,
        )
        _require(
            0 <= self.pad_token_id < self.text_vocab_size,
            "model.pad_token_id",
            f"must be a token id in [0, text_vocab_size={self.text_vocab_size})",
            self.pad_token_id,
        )
        _require(
            len(self.attention_pattern) > 0 and all(k in ATTENTION_KINDS for k in self.attention_pattern),
            "model.attention_pattern",
            f"expected a non-empty list of {', '.join(ATTENTION_KINDS)}",
            self.attention_pattern,
        )
        _require(
            self.last_layer_attention in ATTENTION_KINDS + (None,),
            "model.last_layer_attention",
            f"choose one of {', '.join(ATTENTION_KINDS)} or None",
            self.last_layer_attention,
        )
        _require(
            self.conv_kernel_size % 2 == 1,
            "model.conv_kernel_size",
            "expected an odd number (the window is centred on the position)",
            self.conv_kernel_size,
        )
        for name in ("share_layer_groups", "reversible"):
            _require(
                isinstance(getattr(self, name), bool), f"model.{name}", "expected true or false", getattr(self, name)
            )

    @property
    def image_length(self) -> int:
        return self.image_side * self.image_side

    @property
    def sequence_length(self) -> int:
        return self.text_length + self.image_length

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_plan(self) -> tuple[tuple[int, str], ...]:
        """``(block index, attention kind)`` for every layer, in order.

        Without sharing each layer is its own block. Shared, layer ``i`` uses block ``i % len(attention_pattern)``,
        and the last layer (when ``last_layer_attention`` is set) has a block of its own: 64 layers, pattern of 4 -> 5.
        """
        pattern, plan = self.attention_pattern, []
        blocks: dict[int | str, int] = {}  # block key (layer index, pattern slot or "last") -> block index
        for i in range(self.num_layers):
            key: int | str
            if i == self.num_layers - 1 and self.last_layer_attention is not None:
                key, kind = "last", self.last_layer_attention
            else:
                key, kind = (i % len(pattern) if self.share_layer_groups else i), pattern[i % len(pattern)]
            plan.append((blocks.setdefault(key, len(blocks)), kind))
        return tuple(plan)


@dataclass
class OptimizerConfig:
    """The paper's optimizer: 8-bit LAMB offloaded to CPU inside hivemind.Optimizer (section 3.3)."""

    learning_rate: float = 2.5e-3
    betas: tuple[float, float] = (0.9, 0.96)
    eps: float = 1e-6
    weight_decay: float = 0.045  # not applied to biases and norms
    max_grad_norm: float = 4.0
    # global batches of the linear schedule: global optimizer steps (= global epochs) in synchronous mode; in
    # local-update mode the inner steps follow it by the swarm's global batches, local_steps of them per round
    total_steps: int = 31250
    warmup_fraction: float = 0.1
    target_batch_size: int = 4096  # samples the whole swarm accumulates per global step
    batch_size_per_step: int = 4  # samples one peer processes per local step
    compression_threshold: int = 2**16  # tensors this large or larger are averaged in 8 bits, others in fp16
    matchmaking_time: float = 15.0
    averaging_timeout: float = 180.0
    # how often a peer reads the swarm's progress alone (a sixth to 10/3 of it once it can estimate the next step)
    progress_refresh_period: float = 3.0
    # seconds a peer of an averaging round may stay silent (no part sent, no result returned) before the others go on
    # without it; it also covers the spread of the moments the group's peers notice that a global step is due. None:
    # the longer of matchmaking_time and 3 x the longest time between two readings (10/3 x progress_refresh_period)
    next_chunk_timeout: float | None = None
    # seconds a state download may take before it is started again (a stalled one is noticed after 30 s without a part,
    # swarm.averagers.STATE_DOWNLOAD_PART_TIMEOUT); the paper's model (~717 MiB of state) takes 1200 s at 5 Mbit/s
    load_state_timeout: float = 1800.0
    average_state_every: int = 1  # global steps between parameter (state) averaging rounds
    # how parameters travel in state averaging: "fp16" halves the bytes, "none" (fp32) leaves peers bit-equal
    state_compression: str = "fp16"
    offload_optimizer: bool = True
    delay_optimizer_step: bool = True
    min_8bit_size: int = 4096  # bitsandbytes keeps 32-bit statistics for tensors smaller than this
    # how peers combine their gradients (collab_kit.swarm.robust): "mean" (hivemind's weighted mean) or "centered_clip",
    # which bounds what a peer sending poisoned gradients can do, as long as honest peers hold most of the weight
    aggregation: str = "mean"
    # CenteredClip's radius: parts are clipped at clip_tau x the median distance of the peers' parts from their median;
    # larger lets an attacker pull further (3 tiny peers beside one sending x -1000: 0.5 holds, 1.0 not; benchmarks)
    clip_tau: float = 0.5
    # CenteredClip iterations per part, each about clip_tau from the median toward the honest mean: 30 reach it
    clip_iterations: int = 30
    # Local-update mode (DiLoCo, collab_kit.swarm.local_updates): 0 keeps synchronous training (gradients averaged at
    # every global batch). H > 0: each peer trains on its own with the 8-bit optimizer, and the swarm averages the
    # pseudo-gradients (last global parameters minus the peer's own) once every H global batches' worth of samples:
    # about H times fewer bytes, for thin links. Outer step: SGD with Nesterov momentum, DiLoCo's lr 0.7, momentum 0.9
    local_steps: int = 0
    outer_learning_rate: float = 0.7
    outer_momentum: float = 0.9
    # local-update mode: a round averages in the background while the next round's inner steps go on, its outer step
    # applied when the average arrives, the progress made meanwhile kept (collab_kit.swarm.local_updates)
    overlap_rounds: bool = False
    # local-update mode: 4 sends large tensors' pseudo-gradients in 4 bits, with error feedback (swarm.four_bit)
    pseudo_gradient_bits: int = 8
    # local-update mode: F fragments of the parameters, each averaged once every H global batches, in turn (an epoch
    # is H / F global batches and averages one): a link's peak load falls about F-fold (collab_kit.swarm.fragments)
    fragments: int = 1

    def __post_init__(self):
        self.betas = tuple(self.betas)
        for name in (
            "learning_rate",
            "eps",
            "max_grad_norm",
            "matchmaking_time",
            "averaging_timeout",
            "progress_refresh_period",
            "load_state_timeout",
        ):
            _positive_float("optimizer", name, getattr(self, name))
        if self.next_chunk_timeout is not None:
            _positive_float("optimizer", "next_chunk_timeout", self.next_chunk_timeout)
        for name in (
            "total_steps",
            "target_batch_size",
            "batch_size_per_step",
            "compression_threshold",
            "average_state_every",
            "min_8bit_size",
        ):
            _positive_int("optimizer", name, getattr(self, name))
        _require(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "optimizer.betas",
            "expected two numbers in [0, 1)",
            self.betas,
        )
        _require(
            isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0,
            "optimizer.weight_decay",
            "expected a number >= 0",
            self.weight_decay,
        )
        _require(
            self.state_compression in ("fp16", "none"),
            "optimizer.state_compression",
            "choose 'fp16' or 'none'",
            self.state_compression,
        )
        _require(
            0.0 <= self.warmup_fraction < 1.0, "optimizer.warmup_fraction", "must be in [0, 1)", self.warmup_fraction
        )
        _require(
            self.aggregation in ("mean", "centered_clip"),
            "optimizer.aggregation",
            "choose 'mean' or 'centered_clip'",
            self.aggregation,
        )
        _positive_float("optimizer", "clip_tau", self.clip_tau)
        _require(self.clip_tau < float("inf"), "optimizer.clip_tau", "expected a finite number", self.clip_tau)
        _positive_int("optimizer", "clip_iterations", self.clip_iterations)
        # the leader of a round (the anchor) schedules it up to matchmaking_time ahead and holds it a chunk's timeout
        # for late peers; hivemind refuses a round that cannot start within averaging_timeout, and the anchor then
        # never leads one (tests/test_config.py::test_a_round_must_fit_within_its_timeout)
        least = self.matchmaking_time + self.chunk_timeout
        _require(
            self.averaging_timeout > least,
            "optimizer.averaging_timeout",
            f"a round may start matchmaking_time ({self.matchmaking_time:g} s) plus the wait for late peers "
            f"({self.chunk_timeout:g} s: next_chunk_timeout, or 10 x progress_refresh_period) after it is "
            f"scheduled: set it above {least:g} s, or shorten those",
            self.averaging_timeout,
        )
        _require(
            self.delay_optimizer_step is False or self.offload_optimizer,
            "optimizer.delay_optimizer_step",
            "True needs optimizer.offload_optimizer=True (hivemind runs the delayed step on the offloaded copy)",
            self.delay_optimizer_step,
        )

        _require(
            isinstance(self.local_steps, int) and not isinstance(self.local_steps, bool) and self.local_steps >= 0,
            "optimizer.local_steps",
            "expected an integer >= 0 (0: synchronous training; H > 0: average every H global batches)",
            self.local_steps,
        )
        _positive_float("optimizer", "outer_learning_rate", self.outer_learning_rate)
        _require(
            isinstance(self.outer_momentum, (int, float)) and 0.0 <= self.outer_momentum < 1.0,
            "optimizer.outer_momentum",
            "must be in [0, 1)",
            self.outer_momentum,
        )
        in_mode = "(a setting of the local-update mode) needs optimizer.local_steps set to H > 0 too"
        _require(
            self.overlap_rounds is False or (self.overlap_rounds is True and self.local_updates),
            "optimizer.overlap_rounds",
            f"expected true or false; true {in_mode}",
            self.overlap_rounds,
        )
        _require(
            self.pseudo_gradient_bits == 8 or (self.pseudo_gradient_bits == 4 and self.local_updates),
            "optimizer.pseudo_gradient_bits",
            f"choose 8 or 4; 4 {in_mode}",
            self.pseudo_gradient_bits,
        )
        fragments_fit = (
            type(self.fragments) is int
            and self.fragments >= 1
            and (self.fragments == 1 or (self.local_updates and self.local_steps % self.fragments == 0))
        )
        _require(
            fragments_fit,
            "optimizer.fragments",
            f"expected an integer >= 1; F > 1 {in_mode}, a multiple of F",
            self.fragments,
        )

    @property
    def warmup_steps(self) -> int:
        return int(self.total_steps * self.warmup_fraction)

    @property
    def local_updates(self) -> bool:
        """Whether peers train in local-update mode (``local_steps`` > 0)."""
        return self.local_steps > 0

    @property
    def epoch_batches(self) -> int:
        """Global batches between two averaging rounds (an epoch): 1, or H / F in local-update mode."""
        return max(1, self.local_steps) // self.fragments

    @property
    def round_samples(self) -> int:
        """Samples the whole swarm processes in an epoch (between two averaging rounds): ``epoch_batches`` batches."""
        return self.target_batch_size * self.epoch_batches

    @property
    def chunk_timeout(self) -> float:
        """``next_chunk_timeout``, or the default it stands for when None."""
        default = max(self.matchmaking_time, 3 * self.progress_refresh_period * 10 / 3)
        return default if self.next_chunk_timeout is None else float(self.next_chunk_timeout)


@dataclass
class SwarmConfig:
    """How a peer finds the others: the run's name, whom to contact first, where to listen."""

    run_id: str = "collab_kit"
    initial_peers: Sequence[str] = ()  # multiaddrs of peers already in the swarm; empty = start a new swarm
    # the address to listen on; None: where the swarm can reach this peer (``listen_host``)
    host: str | None = None
    port: int = 0  # 0 = any free port
    # True: this peer connects out but accepts no connections (behind NAT or a firewall); None: asked of the swarm's
    # peers when joining (collab_kit.swarm.reachability); False: it accepts connections
    client_mode: bool | None = None
    use_auto_relay: bool = False  # look for relays so peers behind NAT can still be reached
    identity_path: str | None = None  # a private key file keeps the peer ID across restarts
    announce_maddrs: Sequence[str] = ()  # public addresses to announce, when the host address is not reachable
    # the run's authentication server (collab-kit auth-server), e.g. "https://auth.example.org"; None: an open run
    auth_server: str | None = None

    def __post_init__(self):
        self.announce_maddrs = tuple(self.announce_maddrs)
        _require(
            self.auth_server is None
            or (isinstance(self.auth_server, str) and self.auth_server.startswith(("http://", "https://"))),
            "swarm.auth_server",
            "expected the server's URL, e.g. https://auth.example.org",
            self.auth_server,
        )
        _require(
            isinstance(self.run_id, str) and self.run_id.replace("_", "").replace("-", "").isalnum(),
            "swarm.run_id",
            "use letters, digits, '_' and '-' only",
            self.run_id,
        )
        _require(
            isinstance(self.port, int) and 0 <= self.port < 65536, "swarm.port", "must be in [0, 65535]", self.port
        )
        _require(
            self.host is None or (isinstance(self.host, str) and len(self.host) > 0),
            "swarm.host",
            "expected an IP address such as 127.0.0.1 or 0.0.0.0, or None (where the swarm can reach)",
            self.host,
        )
        self.initial_peers = tuple(parse_initial_peers(self.initial_peers))
        _require(
            self.client_mode in (None, True, False),
            "swarm.client_mode",
            "expected true, false or none (none: found out when joining)",
            self.client_mode,
        )
        _require(
            not (self.client_mode and not self.initial_peers),
            "swarm.client_mode",
            "a client-mode peer accepts no connections, so it cannot start a swarm: give initial_peers",
            self.client_mode,
        )

    @property
    def listen_host(self) -> str:
        """Where this peer listens: ``host`` when set; else loopback for a swarm that stays on this machine (every
        initial peer on 127.0.0.1), and every interface otherwise, so that peers elsewhere can reach it (a first peer
        too: others will join it). Shown by tests/test_config.py::test_a_peer_listens_where_its_swarm_can_reach_it."""
        if self.host is not None:
            return self.host
        return "127.0.0.1" if all_on_this_machine(self.initial_peers) else "0.0.0.0"


@dataclass
class DataConfig:
    """Where training samples come from and how they are batched."""

    # parquet shards (folder or glob), a Hub dataset id, or "synthetic" (made on each peer, collab_kit.data.synthetic);
    # None: the run's own data, as its first peer published it (collab_kit.swarm.run_card)
    shards: str | None = None
    shuffle_buffer: int = 1024
    seed: int = 0
    # how captions become tokens: "bytes" (UTF-8 bytes, no download), "toy" (the toy world's words), or the
    # name of a Hugging Face tokenizer ("t5-small" in the paper)
    tokenizer: str = "t5-small"

    def __post_init__(self):
        _require(
            self.shards is None or (isinstance(self.shards, str) and len(self.shards) > 0),
            "data.shards",
            "expected a folder of parquet shards, a glob, a Hub dataset id or 'synthetic'",
            self.shards,
        )
        _require(
            isinstance(self.tokenizer, str) and len(self.tokenizer) > 0,
            "data.tokenizer",
            "expected 'bytes', 'toy' or a Hugging Face tokenizer name",
            self.tokenizer,
        )
        _require(
            isinstance(self.shuffle_buffer, int) and self.shuffle_buffer >= 1,
            "data.shuffle_buffer",
            "expected an integer >= 1",
            self.shuffle_buffer,
        )


@dataclass
class RunConfig:
    """Everything one peer needs to take part in a run."""

    preset: str = "paper"
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> RunConfig:
        values = dict(values)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        _require(not unknown, "config", f"unknown keys {sorted(unknown)}", sorted(unknown))
        return cls(
            preset=values.get("preset", "custom"),
            model=ModelConfig(**values.get("model", {})),
            optimizer=OptimizerConfig(**values.get("optimizer", {})),
            swarm=SwarmConfig(**values.get("swarm", {})),
            data=DataConfig(**values.get("data", {})),
        )


def _with(config_cls, base: Any, overrides: dict):
    """Build ``config_cls`` from ``base`` with ``overrides``, raising a clear error for unknown fields."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(overrides) - names
    if unknown:
        raise SettingProblem(f"{config_cls.__name__} has no field(s) {sorted(unknown)}; known fields: {sorted(names)}")
    return dataclasses.replace(base, **overrides)


def get_preset(name: str, **overrides: dict) -> RunConfig:
    """Return the named preset, optionally with per-section overrides.

    :param name: one of ``tiny``, ``small``, ``toy``, ``paper``
    :param overrides: ``model=``, ``optimizer=``, ``swarm=``, ``data=`` dictionaries of fields to change
    :example: ``get_preset("small", optimizer=dict(target_batch_size=64))``
    """
    if name not in PRESETS:
        raise SettingProblem(f"preset={name!r} is not allowed: choose one of {', '.join(PRESETS)}")
    unknown = set(overrides) - {"model", "optimizer", "swarm", "data"}
    _require(not unknown, "get_preset's sections", "use model=, optimizer=, swarm=, data=", sorted(unknown))

    if name == "paper":
        model, optimizer = ModelConfig(), OptimizerConfig()
    elif name == "small":
        model = ModelConfig(
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            text_length=16,
            image_side=8,
            codebook_size=256,
            text_vocab_size=259,
            pad_token_id=0,
            conv_kernel_size=5,
        )
        # a short schedule, out of warm-up in a few global steps, and a high peak rate: a demo has few steps to learn
        optimizer = OptimizerConfig(
            learning_rate=2e-2,
            total_steps=100,
            warmup_fraction=0.03,
            target_batch_size=256,
            batch_size_per_step=16,
            matchmaking_time=3.0,
            averaging_timeout=30.0,
            progress_refresh_period=0.6,
        )
    elif name == "toy":
        # 12 word tokens, 8 x 8 codes of 512; 128 wide learns shapes about as fast per step as 256, a third the cost
        model = ModelConfig(
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            text_length=12,
            image_side=8,
            codebook_size=512,
            text_vocab_size=27,
            pad_token_id=0,
            conv_kernel_size=5,
        )
        # Learnt in steps (300 steps of 32 drew 0.66-0.81 of the shapes, 240 steps 0.63-0.75, 120 of 64 hardly any):
        # a peer's step of 16 is a global step; 0.4 s matchmaking suits one machine or a LAN. A step costs 1.0 s, 2.8 s
        # at a target of 32 (a peer stepped twice before it saw the other's). Stale gradients halved the progress per
        # step; fp16 gradients cost bytes, not time; state averaging only guards against drift.
        optimizer = OptimizerConfig(
            learning_rate=3e-2,
            total_steps=300,
            warmup_fraction=0.03,
            target_batch_size=16,
            batch_size_per_step=16,
            compression_threshold=2**20,
            delay_optimizer_step=False,
            average_state_every=5,
            matchmaking_time=0.4,
            averaging_timeout=30.0,
            progress_refresh_period=0.6,
        )
    else:  # tiny
        model = ModelConfig(
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            text_length=8,
            image_side=4,
            codebook_size=32,
            text_vocab_size=259,
            pad_token_id=0,
            conv_kernel_size=3,
        )
        # a step takes milliseconds: a large target batch makes an epoch last a second, for peers to see it in the DHT
        optimizer = OptimizerConfig(
            learning_rate=1e-2,
            total_steps=100,
            warmup_fraction=0.02,
            target_batch_size=2048,
            batch_size_per_step=8,
            matchmaking_time=2.0,
            averaging_timeout=20.0,
            progress_refresh_period=0.6,
        )
    config = RunConfig(preset=name, model=model, optimizer=optimizer)
    if name != "paper":
        config.swarm = SwarmConfig(run_id=f"collab_kit_{name}")
        config.data = DataConfig(tokenizer="toy" if name == "toy" else "bytes")
    for section, config_cls in (
        ("model", ModelConfig),
        ("optimizer", OptimizerConfig),
        ("swarm", SwarmConfig),
        ("data", DataConfig),
    ):
        if section in overrides:
            setattr(config, section, _with(config_cls, getattr(config, section), overrides[section]))
    return config


# ---------------------------------------------------------------------------------------------
# a configuration as command-line options (collab-kit reads --set values with ast.literal_eval)


def command_line_literal(section: str, name: str, value) -> str:
    """``value`` as ``--set section.name=VALUE`` takes it. :raises ValueError: a value the command line cannot carry"""
    if isinstance(value, list):
        value = tuple(value)
    text = repr(value)
    try:
        same = ast.literal_eval(text) == value
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise SettingProblem(
            f"{section}.{name}={value!r} cannot be passed on the command line: use a number, a "
            f"string, a boolean, None or a tuple of these"
        )
    return text


# fields each peer chooses for its own machine (the preflight sets the first two): its activations, local batch,
# optimizer state's place, steps or rounds in the background, download time. The swarm's weights and steps are the
# same whatever each chooses, so a join line must not force one peer's choices on another machine.
PER_PEER_SETTINGS = frozenset(
    {
        ("model", "reversible"),
        ("optimizer", "batch_size_per_step"),
        ("optimizer", "offload_optimizer"),
        ("optimizer", "delay_optimizer_step"),
        ("optimizer", "load_state_timeout"),
        ("optimizer", "overlap_rounds"),
    }
)


# data fields every peer of a run must share: the same caption gives every peer the same token ids
SHARED_DATA_SETTINGS = ("tokenizer",)


def shared_settings(config: RunConfig) -> dict[tuple[str, str], Any]:
    """Every setting the peers of ``config``'s run must share, ``(section, field) -> value``: each model and optimizer
    field but :data:`PER_PEER_SETTINGS`, and :data:`SHARED_DATA_SETTINGS`. What a run publishes and a peer compares
    (collab_kit.swarm.run_card); the rest of the data and swarm sections is each peer's own."""
    settings = {}
    for section in ("model", "optimizer"):
        for item in dataclasses.fields(getattr(config, section)):
            if (section, item.name) not in PER_PEER_SETTINGS:
                settings[(section, item.name)] = getattr(getattr(config, section), item.name)
    for name in SHARED_DATA_SETTINGS:
        settings[("data", name)] = getattr(config.data, name)
    return settings


def shared_setting_options(config: RunConfig) -> list[str]:
    """The ``collab-kit join`` options every peer of ``config``'s run must share: ``--preset``, ``--run-id``, a
    ``--set`` (shell-quoted) for each of its :func:`shared_settings` that differs from the preset's, and the run's auth
    server. The rest of the data and swarm settings and :data:`PER_PEER_SETTINGS` are each peer's own.

    A config not made from a preset (``get_preset``) gives ``--run-id`` and ``--set`` for every field of the paper
    preset's that differs.
    """
    preset = config.preset if config.preset in PRESETS else "paper"
    options = ["--preset", preset, "--run-id", config.swarm.run_id]
    base = shared_settings(get_preset(preset))
    for (section, name), value in shared_settings(config).items():
        if value != base[(section, name)]:
            options += ["--set", shlex.quote(f"{section}.{name}={command_line_literal(section, name, value)}")]
    if config.swarm.auth_server:
        options += ["--set", shlex.quote(f"swarm.auth_server={config.swarm.auth_server}")]
    return options


def parse_overrides(assignments: Sequence[str]) -> dict[str, dict]:
    """Turn ``["optimizer.target_batch_size=64", ...]`` into ``{"optimizer": {"target_batch_size": 64}}``."""
    overrides: dict[str, dict] = {}
    for assignment in assignments:
        key, sep, raw_value = assignment.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise SettingProblem(
                f"--set {assignment!r}: expected SECTION.FIELD=VALUE, for example --set optimizer.target_batch_size=64"
            )
        try:
            value = ast.literal_eval(raw_value)
        except (ValueError, SyntaxError):
            value = {"true": True, "false": False}.get(raw_value.strip().lower(), raw_value)
        overrides.setdefault(section, {})[name] = value
    return overrides
