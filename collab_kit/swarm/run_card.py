"""A run's card: the settings every peer of the run must share and the run's data, published by its first peer.

    card = RunCard.of(config, data="someone/laion-codes", author=dht.peer_id.to_base58())
    keeper = RunCardKeeper(dht, card)                      # the organizer's peer: stored now, kept fresh
    ...
    card = find_run_card(dht, config.swarm.run_id, config.swarm.initial_peers)   # a peer that joins
    check_fits_run(config, card)                            # RunMismatch: one sentence, before any step

The run's first peer (the monitor, or a volunteer that starts a swarm) publishes the card in the DHT under the key
``collab_kit_runs``, one key for every run a DHT holds (a peer that names the wrong run id learns which run is
there), subkeyed by its RSA public key: ``RSASignatureValidator`` lets only its author write it, and
``SchemaValidator`` keeps out what is not a card. A peer that joins reads it before it builds its model, compares
its own preset and shared settings (collab_kit.config.shared_settings, the training mode among them), and streams the
run's data when it names none of its own (``choose_data``). Its join line carries the same settings and data.

Shown by tests/swarm/test_run_card.py (a card kept, read and compared on real DHTs) and
tests/cli/test_join_errors.py (every way a pasted line can fail before training, one sentence each).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import threading
import time
from collections.abc import Sequence
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, constr

from collab_kit.addresses import all_on_this_machine
from collab_kit.config import PRESETS, RunConfig, SettingProblem, get_preset, shared_setting_options, shared_settings
from collab_kit.data.shards import DataSourceError, is_hub_dataset, list_shards, misfit_for_run
from collab_kit.data.synthetic import SYNTHETIC, SYNTHETIC_SAMPLES, synthetic_shards_folder
from collab_kit.errors import CollabKitError

logger = logging.getLogger(__name__)

KEY_PREFIX, KEY_FIELD = "collab_kit", "runs"
RUNS_KEY = f"{KEY_PREFIX}_{KEY_FIELD}"  # the DHT key every card is stored under
CARD_LIFETIME = 300.0  # seconds a stored card lives; its keeper stores it again well before
REFRESH_EVERY = 60.0


class RunMismatch(CollabKitError, ValueError):
    """This peer's run id, preset or shared settings are not the run's: the message names them and the line to use."""


class DataMismatch(SettingProblem):
    """The data this peer would train on cannot feed the run (none named, out of reach, or shards of another model)."""


class RunCardRecord(BaseModel):
    """A card as it travels in the DHT: plain strings and a number (the settings as JSON)."""

    # mypy reads pydantic's constr as a call, not the type it builds: valid-type ignored on each
    run_id: constr(strict=True, min_length=1, max_length=128)  # type: ignore[valid-type]
    preset: constr(strict=True, min_length=1, max_length=32)  # type: ignore[valid-type]
    # JSON: {"model": {...}, "optimizer": {...}, "data": {...}}
    settings: constr(strict=True, max_length=32768)  # type: ignore[valid-type]
    data: constr(strict=True, min_length=1, max_length=1024) | None = None  # type: ignore[valid-type]
    # the author's libp2p peer id, base58
    author: constr(strict=True, min_length=1, max_length=128)  # type: ignore[valid-type]
    time: StrictFloat


class RunCardSchema(BaseModel):
    """The DHT key ``collab_kit_runs``: one card per author, under the author's public key."""

    runs: dict[BytesWithPublicKey, RunCardRecord | None]


def run_card_validators() -> list:
    """The record validators a DHT needs to store or read cards (the monitor's and every peer's)."""
    return [SchemaValidator(RunCardSchema, prefix=KEY_PREFIX), RSASignatureValidator()]


@dataclasses.dataclass
class RunCard:
    """What a run tells the peers that join it.

    :param run_id: the run's id
    :param preset: the preset its settings start from
    :param settings: every shared setting, ``{section: {field: value}}`` (collab_kit.config.shared_settings)
    :param data: the run's data: a Hub dataset id, a folder or glob of shards (on the organizer's machine),
      ``"synthetic"`` (every peer makes the picture world's codes), or None (the organizer named none)
    :param author: the peer id of the peer that published it
    :param time: DHT time of publication
    """

    run_id: str
    preset: str
    settings: dict[str, dict[str, Any]]
    data: str | None = None
    author: str = ""
    time: float = 0.0

    @classmethod
    def of(cls, config: RunConfig, data: str | None, author: str) -> RunCard:
        """The card of ``config``'s run, with ``data`` as peers elsewhere can name it (a local path made absolute)."""
        settings: dict[str, dict[str, Any]] = {}
        for (section, name), value in shared_settings(config).items():
            settings.setdefault(section, {})[name] = list(value) if isinstance(value, tuple) else value
        preset = config.preset if config.preset in PRESETS else "paper"
        return cls(
            run_id=config.swarm.run_id,
            preset=preset,
            settings=settings,
            data=published_data(data),
            author=author,
            time=get_dht_time(),
        )

    def to_record(self) -> dict:
        return RunCardRecord(
            run_id=self.run_id,
            preset=self.preset,
            settings=json.dumps(self.settings),
            data=self.data,
            author=self.author,
            time=float(self.time),
        ).dict()

    @classmethod
    def from_record(cls, value) -> RunCard:
        """:raises ValueError: a value that is not a card (pydantic's ValidationError, or settings that are not JSON)"""
        record = RunCardRecord.parse_obj(value)
        settings = json.loads(record.settings)
        if not isinstance(settings, dict) or not all(isinstance(fields, dict) for fields in settings.values()):
            raise ValueError("a card's settings must map each section to its fields")
        return cls(
            run_id=record.run_id,
            preset=record.preset,
            settings=settings,
            data=record.data,
            author=record.author,
            time=record.time,
        )

    def run_config(self) -> RunConfig:
        """The run's configuration: its preset with its settings (this peer's own swarm section is the preset's).

        :raises RunMismatch: settings this collab_kit does not know (a newer kit published them)
        """
        try:
            sections = {section: dict(fields) for section, fields in self.settings.items()}
            return get_preset(self.preset, **sections, swarm=dict(run_id=self.run_id))
        except (ValueError, TypeError) as e:
            raise RunMismatch(
                f"run {self.run_id!r} uses settings this collab_kit does not know ({e}): upgrade "
                f"collab_kit (pip install -U collab_kit)"
            ) from None

    def join_options(self) -> list[str]:
        """The options of ``collab-kit join`` that join this run (its line without the addresses)."""
        options = shared_setting_options(self.run_config())
        return options + (["--data", shlex.quote(self.data)] if self.data else [])


def published_data(data: str | None) -> str | None:
    """``data`` as a run publishes it: a local folder or file made absolute (peers started elsewhere on this machine
    find it), a Hub dataset id, a glob or ``synthetic`` as they are; None for none."""
    if data and data != SYNTHETIC and not is_hub_dataset(data) and os.path.exists(data):
        return os.path.abspath(data)
    return data or None


# -- the author's side -----------------------------------------------------------------------------------------


def publish_run_card(
    dht: hivemind.DHT, card: RunCard, signer: RSASignatureValidator, lifetime: float = CARD_LIFETIME, wait: bool = True
) -> bool:
    """Store ``card`` under this peer's public key; returns whether the DHT took it (True at once without ``wait``)."""
    card = dataclasses.replace(card, time=get_dht_time())
    stored = dht.store(
        RUNS_KEY,
        subkey=signer.local_public_key,
        value=card.to_record(),
        expiration_time=get_dht_time() + lifetime,
        return_future=not wait,
    )
    return True if not wait else bool(stored)


class RunCardKeeper:
    """Keeps a run's card in the DHT: stores it now, then again every ``refresh_every`` seconds, until ``stop``.

    :param dht: the author's DHT (``run_card_validators`` among its validators)
    :param card: the card
    """

    def __init__(self, dht: hivemind.DHT, card: RunCard, refresh_every: float = REFRESH_EVERY):
        self.dht, self.card, self.refresh_every = dht, card, refresh_every
        self._signer = RSASignatureValidator()
        self._stop = threading.Event()
        if not publish_run_card(dht, card, self._signer):
            logger.warning(
                f"the DHT did not take this run's card yet (no peer stored it): trying again in {refresh_every:g} s"
            )
        self._thread = threading.Thread(target=self._run, daemon=True, name="collab_kit-run-card")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_every):
            try:
                publish_run_card(self.dht, self.card, self._signer)
            except Exception as e:  # a DHT shutting down, a moment without neighbours: the card lives on a while
                logger.debug(f"could not refresh the run's card: {e}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- the joining peer's side -----------------------------------------------------------------------------------


def read_run_cards(dht: hivemind.DHT) -> list[RunCard]:
    """Every well-formed card the DHT holds (its validators have checked signatures and the schema already)."""
    found = dht.get(RUNS_KEY, latest=True)
    cards: list[RunCard] = []
    if found is None or not isinstance(found.value, dict):
        return cards
    for entry in found.value.values():
        try:
            cards.append(RunCard.from_record(entry.value))
        except Exception as e:  # pydantic's ValidationError, bad JSON: a card of nobody's run
            logger.debug(f"skipped a malformed run card: {e}")
    return cards


def _peer_ids(addresses: Sequence[str]) -> list[str]:
    ids = []
    for address in addresses:
        try:
            ids.append(Multiaddr(address).value_for_protocol("p2p"))
        except Exception:  # an address without /p2p/ (parse_initial_peers lets none through)
            continue
    return ids


def find_run_card(dht: hivemind.DHT, run_id: str, initial_peers: Sequence[str], timeout: float = 8.0) -> RunCard | None:
    """The card of ``run_id`` in the swarm this peer joined through ``initial_peers``.

    Of several cards of one run (its monitor restarted, say), the one an initial peer wrote comes first, then the
    newest. Waits up to ``timeout`` seconds for any card (a DHT just joined may need a moment); None when the swarm
    holds none (peers of an older collab_kit, or of another tool).

    :raises RunMismatch: the swarm holds cards of other runs only: this peer names the wrong run id
    """
    deadline = time.monotonic() + timeout
    while True:
        cards = read_run_cards(dht)
        ours = [card for card in cards if card.run_id == run_id]
        if ours:
            authors = set(_peer_ids(initial_peers))
            return max(ours, key=lambda card: (card.author in authors, card.time))
        if cards:
            runs = sorted({card.run_id for card in cards})
            example = max(cards, key=lambda card: card.time)
            raise RunMismatch(
                f"the swarm at {', '.join(initial_peers)} trains run {' and '.join(map(repr, runs))}, not "
                f"{run_id!r}: join with the line the run printed, e.g. collab-kit join "
                f"{' '.join(example.join_options())} --initial-peers {' '.join(initial_peers)}"
            )
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def _shown(value) -> str:
    return repr(tuple(value) if isinstance(value, list) else value)


def settings_mismatch(config: RunConfig, card: RunCard) -> str | None:
    """What in ``config`` does not fit ``card``'s run, in words (None: it fits): the preset, the training mode, then
    every other shared setting that differs."""
    preset = config.preset if config.preset in PRESETS else "paper"  # a config of no preset is the paper's, changed
    if preset != card.preset:
        return f"this peer uses preset {config.preset!r} and run {card.run_id!r} trains preset {card.preset!r}"
    theirs = shared_settings(card.run_config())
    ours = shared_settings(config)
    mine, run = ours[("optimizer", "local_steps")], theirs[("optimizer", "local_steps")]
    if bool(mine) != bool(run):

        def mode(steps: int) -> str:
            return (
                f"in the local-update mode (optimizer.local_steps={steps})"
                if steps
                else "synchronously (optimizer.local_steps=0)"
            )

        return f"this peer would train {mode(mine)} and run {card.run_id!r} trains {mode(run)}"
    differing = [
        f"{section}.{name}={_shown(ours[(section, name)])} where the run has {_shown(value)}"
        for (section, name), value in theirs.items()
        if ours.get((section, name)) != value
    ]
    if differing:
        return f"this peer's settings differ from run {card.run_id!r}'s: {'; '.join(differing)}"
    return None


def check_fits_run(config: RunConfig, card: RunCard, initial_peers: Sequence[str]) -> None:
    """:raises RunMismatch: ``config`` does not fit ``card``'s run (``settings_mismatch``), with the line that fits"""
    problem = settings_mismatch(config, card)
    if problem is not None:
        raise RunMismatch(
            f"{problem}: join with the run's settings, as in the line it printed: collab-kit join "
            f"{' '.join(card.join_options())} --initial-peers {' '.join(initial_peers)} (in the join "
            f"notebook: PRESET, RUN_ID, OPTIMIZER_SETTINGS and LOCAL_STEPS)"
        )


# -- the data a peer trains on ---------------------------------------------------------------------------------


def choose_data(
    given: str | None,
    card: RunCard | None,
    config: RunConfig,
    setting: str = "--data",
    synthetic_fallback: bool = False,
) -> str:
    """The data source this peer trains on: its own (``given``), else the run's (the card's), else, where allowed,
    synthetic data for a swarm of its own or one on this machine. Synthetic data never feeds a run elsewhere that
    did not choose it.

    :param setting: how the user names the data (``--data``, ``DATA_SHARDS``), for the message
    :param synthetic_fallback: with no data named anywhere, make synthetic data for a new swarm, or a swarm whose
      every initial peer is on this machine (the join notebook's way)
    :raises DataMismatch: no data is named
    """
    if given:
        return given
    if card is not None and card.data:
        return card.data
    initial_peers = config.swarm.initial_peers
    if synthetic_fallback and (not initial_peers or all_on_this_machine(initial_peers)):
        return SYNTHETIC
    if card is not None:
        raise DataMismatch(
            f"run {card.run_id!r} names no data (its organizer started it without --data): pass "
            f"{setting} with shards made for it (ask its organizer which), or ask them to name the "
            f"run's data"
        )
    if initial_peers:
        raise DataMismatch(
            f"the swarm at {', '.join(initial_peers)} publishes no data for run "
            f"{config.swarm.run_id!r}: pass {setting} with shards made for it"
        )
    raise DataMismatch(
        f"a new swarm needs data: pass {setting} with a folder of parquet shards, a glob or a Hub "
        f"dataset id (collab-kit preprocess makes them), or {setting} synthetic for made-up shapes"
    )


def check_data_fits(source: str, config: RunConfig, label: str, setting: str = "--data") -> None:
    """Check that ``source`` can feed ``config``'s run: its shards are there (or its Hub dataset can be reached) and
    their metadata fits the model (``misfit_for_run``). Synthetic data is made for the run's model: it always fits.

    :param label: how to name ``source`` in a message ("--data 'x'", "the run's data 'x'")
    :raises DataMismatch: the data cannot be read (a Hub dataset out of reach, no shards) or does not fit the run
    """
    if source == SYNTHETIC:
        return
    model = config.model
    try:
        paths = list_shards(source)
    except DataSourceError as e:
        raise DataMismatch(f"{label}: {e}; or point {setting} at shards made for run {config.swarm.run_id!r}") from None
    try:
        misfit = misfit_for_run(paths, model.codebook_size, model.image_side, config.data.tokenizer)
    except DataSourceError as e:
        raise DataMismatch(f"{label}: {e}") from None
    except Exception as e:  # a shard whose footer cannot be read is the stream's to skip, not a reason to stop
        logger.debug(f"could not read the metadata of {source}: {e}")
        misfit = None
    if misfit is not None:
        raise DataMismatch(
            f"{label} does not fit run {config.swarm.run_id!r}: {misfit}; point {setting} at shards made for this run"
        )


def ready_data(
    source: str, config: RunConfig, label: str, setting: str = "--data", synthetic_samples: int = SYNTHETIC_SAMPLES
) -> str:
    """``source`` checked against the run (``check_data_fits``) and as a stream reads it: synthetic data made for the
    model's grid and codebook (a folder), anything else as it is.

    :param synthetic_samples: samples to make for synthetic data
    :raises DataMismatch: as ``check_data_fits``
    """
    check_data_fits(source, config, label, setting)
    if source == SYNTHETIC:
        return synthetic_shards_folder(config.model.image_side, config.model.codebook_size, synthetic_samples)
    return source


@dataclasses.dataclass
class PeerData:
    """What a peer trains on: ``source`` as the run names it, ``shards`` as its stream reads them, in words."""

    source: str
    shards: str
    description: str


def data_for_peer(
    given: str | None,
    card: RunCard | None,
    config: RunConfig,
    setting: str = "--data",
    synthetic_fallback: bool = False,
    synthetic_samples: int = SYNTHETIC_SAMPLES,
) -> PeerData:
    """The data a peer trains on (``choose_data``), checked against the run and made ready (``ready_data``).

    :raises DataMismatch: none named, out of reach, or shards of another model (one sentence naming ``setting``)
    """
    source = choose_data(given, card, config, setting=setting, synthetic_fallback=synthetic_fallback)
    label = f"{setting} {source!r}" if given else f"the run's data {source!r}"
    shards = ready_data(source, config, label, setting=setting, synthetic_samples=synthetic_samples)
    return PeerData(source, shards, f"training on {label}" + (f" (made in {shards})" if shards != source else ""))
