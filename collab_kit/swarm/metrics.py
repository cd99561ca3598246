"""Per-peer metrics: what each training peer tells the monitor about itself, signed, in the DHT.

Every training peer publishes one record under the run's key ``<run_id>_metrics``, subkeyed by its
RSA public key (hivemind's ownership marker), after each global epoch:

    PeerMetrics(peer_id, username, epoch, samples_per_second, samples_accumulated, loss, mini_steps,
                compute_seconds, time)

Two validators guard the key, on every DHT node that stores or reads it:
- ``RSASignatureValidator``: a value under a subkey that holds a public key must be signed by that
  key, so no peer can write (or overwrite) another peer's record;
- ``SchemaValidator(MetricsSchema)``: the subkey must hold a public key and the value must be a
  well-formed ``PeerMetrics`` (types, ranges, a finite loss), so a broken or hostile peer cannot
  feed the monitor garbage.

Records expire (``expiration`` seconds after they are written, 5 minutes by default), so a peer that
leaves drops out of "alive peers" on its own. ``samples_accumulated`` and ``compute_seconds`` count
from the peer's start; the monitor turns their growth into the contributors' table.

``username`` is what the peer says it is; the monitor credits a username only when the peer's
binding record (collab_kit.auth.client) proves that peer id holds that user's access token.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.timed_storage import get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, confloat, conint, constr, validator

from collab_kit.swarm.keys import metrics_key

logger = logging.getLogger(__name__)

DEFAULT_EXPIRATION = 300.0  # seconds a record stays alive after it is written


class PeerMetrics(BaseModel):
    """One training peer's report, as published in the DHT (a plain dict of these fields on the wire)."""

    # mypy reads pydantic's constr/conint/confloat as calls, not the types they build: valid-type ignored on each
    # base58 libp2p peer id, for display
    peer_id: constr(strict=True, min_length=1, max_length=128)  # type: ignore[valid-type]
    # claimed; see the module docstring
    username: constr(strict=True, min_length=1, max_length=96) | None = None  # type: ignore[valid-type]
    epoch: conint(ge=0, strict=True)  # type: ignore[valid-type]  # the global epoch (optimizer step) the peer is at
    samples_per_second: confloat(ge=0.0, strict=True)  # type: ignore[valid-type]  # the peer's recent throughput
    # samples this peer has processed since it started
    samples_accumulated: conint(ge=0, strict=True)  # type: ignore[valid-type]
    loss: StrictFloat  # mean loss of its local steps in its last global epoch
    mini_steps: conint(ge=0, strict=True)  # type: ignore[valid-type]  # local steps (micro-batches) in that epoch
    # seconds spent training since it started
    compute_seconds: confloat(ge=0.0, strict=True)  # type: ignore[valid-type]
    time: StrictFloat  # DHT time of the report
    # its last gradient round: how many other training peers it was averaged with (0: alone), how many global epochs
    # in a row went unaveraged while others trained, and why (None for peers that do not report it)
    averaged_with: conint(ge=0, strict=True) | None = None  # type: ignore[valid-type]
    lone_epochs: conint(ge=0, strict=True) | None = None  # type: ignore[valid-type]
    lone_reason: constr(strict=True, max_length=300) | None = None  # type: ignore[valid-type]
    # where it trains and in what precision ("Tesla T4", "fp16"; collab_kit.model.device), for the leaderboard
    device: constr(strict=True, max_length=64) | None = None  # type: ignore[valid-type]
    precision: constr(strict=True, regex=r"^(fp32|bf16|fp16)$") | None = None  # type: ignore[valid-type]
    # what it is busy with instead of training, said as it starts ("downloading_state": the swarm's state), until its
    # next epoch's record
    activity: constr(strict=True, regex=r"^downloading_state$") | None = None  # type: ignore[valid-type]

    @validator("loss", "samples_per_second", "compute_seconds", "time")
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    class Config:
        extra = "forbid"  # an unknown field is a malformed record, not something to carry along


class MetricsSchema(BaseModel):
    """The DHT key ``<run_id>_metrics``: one record per peer, under that peer's public key."""

    metrics: dict[BytesWithPublicKey, PeerMetrics | None]


def metrics_validators(run_id: str, signature_validator: RSASignatureValidator | None = None) -> list:
    """The record validators a DHT needs to write or read ``run_id``'s metrics.

    :param signature_validator: the peer's own (it holds the key records are signed with); default: a
      validator with the process-wide key, the one hivemind.Optimizer's progress records also use
    """
    return [SchemaValidator(MetricsSchema, prefix=run_id), signature_validator or RSASignatureValidator()]


@dataclass
class SwarmSnapshot:
    """The run as the metrics records show it at one moment (one row of the monitor's time series)."""

    time: float  # DHT time of the reading
    epoch: int  # the highest global epoch any peer reports
    loss: float | None  # mean of the alive peers' losses, weighted by their local steps (None: no peer)
    alive_peers: int
    samples_per_second: float  # the whole swarm's throughput
    anchors: int | None = None  # the run's anchors alive (None: not counted)
    samples: int | None = None  # every sample credited to the contributors so far (set when the poll is stored)


def summarize(records: list[PeerMetrics], now: float | None = None) -> SwarmSnapshot:
    """Aggregate alive peers' records into one point of the run's time series."""
    now = get_dht_time() if now is None else now
    if not records:
        return SwarmSnapshot(time=now, epoch=0, loss=None, alive_peers=0, samples_per_second=0.0)
    trained = [record for record in records if record.mini_steps > 0]  # a joiner's first record says no loss yet
    weights = [record.mini_steps for record in trained]
    loss = sum(weight * record.loss for weight, record in zip(weights, trained)) / sum(weights) if trained else None
    return SwarmSnapshot(
        time=now,
        epoch=max(record.epoch for record in records),
        loss=loss,
        alive_peers=len(records),
        samples_per_second=sum(r.samples_per_second for r in records),
    )


class MetricsPublisher:
    """Publishes this peer's records; keeps the running totals that go into them.

    :param dht: this peer's DHT (the validators are added to it here)
    :param run_id: the run's id
    :param username: the authenticated user's name (None in an open run)
    :param expiration: seconds each record stays alive
    """

    def __init__(
        self, dht: hivemind.DHT, run_id: str, username: str | None = None, expiration: float = DEFAULT_EXPIRATION
    ):
        self.dht, self.run_id, self.username, self.expiration = dht, run_id, username, expiration
        self._signature_validator = RSASignatureValidator()
        dht.add_validators(metrics_validators(run_id, self._signature_validator))
        self.public_key_subkey: bytes = self._signature_validator.local_public_key
        self.samples_accumulated = 0
        self.compute_seconds = 0.0
        self._last_report: dict | None = None  # the last epoch's figures (publish's arguments)

    def add_work(self, samples: int, seconds: float) -> None:
        """Count samples processed and seconds spent on them (called as training goes)."""
        self.samples_accumulated += int(samples)
        self.compute_seconds += float(seconds)

    def publish(
        self,
        epoch: int,
        loss: float,
        mini_steps: int,
        samples_per_second: float,
        wait: bool = True,
        averaged_with: int | None = None,
        lone_epochs: int | None = None,
        lone_reason: str | None = None,
        device: str | None = None,
        precision: str | None = None,
    ) -> bool:
        """Store this peer's record now; returns whether the DHT accepted it.

        A non-finite loss is not published (the schema would refuse it): the record is skipped with a
        warning and the previous one expires in its own time.

        :param wait: wait for the DHT's answer; False returns True at once and stores in the background
          (what the training loop does: a slow DHT must not hold up a step)
        :param averaged_with: other training peers in its last gradient round (0: it stepped alone)
        :param lone_epochs: global epochs in a row not averaged while other peers trained
        :param lone_reason: why they were not (None when averaged)
        :param device: the device it trains on, by name; ``precision``: fp32, bf16 or fp16
        """
        if not math.isfinite(loss):
            logger.warning(f"not publishing metrics for epoch {epoch}: the loss is {loss}")
            return False
        self._last_report = dict(
            epoch=epoch,
            loss=loss,
            mini_steps=mini_steps,
            samples_per_second=samples_per_second,
            averaged_with=averaged_with,
            lone_epochs=lone_epochs,
            lone_reason=lone_reason,
            device=device,
            precision=precision,
        )
        return self._store_record(activity=None, wait=wait, **self._last_report)

    def publish_activity(
        self, activity: str, epoch: int, device: str | None = None, precision: str | None = None
    ) -> bool:
        """Say what this peer is busy with now (``"downloading_state"``), with its last epoch's figures (none yet: no
        loss, zero local steps); its next epoch's record ends it. Stored in the background."""
        report = dict(
            self._last_report
            or dict(
                loss=0.0,
                mini_steps=0,
                samples_per_second=0.0,
                averaged_with=None,
                lone_epochs=None,
                lone_reason=None,
                device=device,
                precision=precision,
            ),
            epoch=epoch,
        )
        return self._store_record(activity=activity, wait=False, **report)

    def _store_record(
        self,
        epoch: int,
        loss: float,
        mini_steps: int,
        samples_per_second: float,
        wait: bool,
        averaged_with: int | None,
        lone_epochs: int | None,
        lone_reason: str | None,
        device: str | None,
        precision: str | None,
        activity: str | None,
    ) -> bool:
        record = PeerMetrics(
            peer_id=self.dht.peer_id.to_base58(),
            username=self.username,
            epoch=int(epoch),
            samples_per_second=float(samples_per_second),
            samples_accumulated=self.samples_accumulated,
            loss=float(loss),
            mini_steps=int(mini_steps),
            compute_seconds=self.compute_seconds,
            time=get_dht_time(),
            averaged_with=None if averaged_with is None else max(0, int(averaged_with)),
            lone_epochs=None if lone_epochs is None else int(lone_epochs),
            lone_reason=None if lone_reason is None else str(lone_reason)[:300],
            device=None if device is None else str(device)[:64],
            precision=precision,
            activity=activity,
        )
        stored = self.dht.store(
            metrics_key(self.run_id),
            subkey=self.public_key_subkey,
            value=record.dict(),
            expiration_time=get_dht_time() + self.expiration,
            return_future=not wait,
        )
        if not wait:
            return True
        if not stored:
            logger.warning("the DHT did not accept this peer's metrics record (no reachable peer stored it)")
        return bool(stored)


def read_metrics(dht: hivemind.DHT, run_id: str) -> list[tuple[bytes, PeerMetrics]]:
    """The alive peers' records: (the subkey, i.e. the signer's public key marker, the record).

    The DHT has already checked signatures and schema (with ``metrics_validators`` added to it); the
    records are parsed again here so that a DHT without the validators cannot hand over garbage.
    """
    found = dht.get(metrics_key(run_id), latest=True)
    records: list[tuple[bytes, PeerMetrics]] = []
    if found is None or not isinstance(found.value, dict):
        return records
    for subkey, entry in found.value.items():
        try:
            records.append((subkey, PeerMetrics.parse_obj(entry.value)))
        except Exception as e:  # pydantic's ValidationError, or a value that is not a dict
            logger.warning(f"skipped a malformed metrics record: {e}")
    return records
