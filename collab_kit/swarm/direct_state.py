"""States passed between the peers a trainer names, beside hivemind's rule that only peers accepting connections
share theirs: the way an anchor started again takes the newest state from the volunteers behind NAT; and states
downloaded in parts from several peers at once, so that late joiners do not all load one peer's link."""

from __future__ import annotations

import asyncio
import logging
import random
import typing
from collections.abc import Iterable, Sequence
from typing import AsyncIterator  # noqa: UP035 (hivemind finds a stream rpc_ handler by typing's hint)

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from collab_kit.swarm.kept_tasks import kept_until_done

logger = logging.getLogger(__name__)

STATE_PART_SOURCES = 4  # the most peers one download of the state takes parts from


def state_parts(sizes: Sequence[int], count: int) -> list[list[int]]:
    """The indices of tensors of ``sizes`` (values each) split into ``count`` parts of about equal total size: largest
    first, each to the part with the least so far (the first such part on a tie). Every peer computes the same parts
    for the same model, so a part asked of one peer fits with the parts asked of others."""
    parts: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        smallest = min(range(count), key=lambda part: (totals[part], part))
        parts[smallest].append(index)
        totals[smallest] += sizes[index]
    return [sorted(part) for part in parts]


class _NoStateToServe(RuntimeError):
    """No peer whose state this one serves gave it (the download asking for it fails, and asks another peer)."""


if typing.TYPE_CHECKING:
    _AveragerBase: typing.TypeAlias = DecentralizedAverager  # the type checker's view: what the mixin is put before
else:
    _AveragerBase = object


class DirectStateMixin(_AveragerBase):
    """Put before TrainingStateAverager: states pass between the peers a trainer names, beside hivemind's rule (only
    peers that accept connections share their state, found through the DHT).

    - A peer in client mode serves its state to the peers of ``serve_state_to`` (the run's anchors, its initial
      peers): nobody can dial it, but a connection it opened carries streams both ways, so an anchor started again
      can take the newest state from the volunteers behind NAT that reconnected to it. It is never announced in the
      DHT: other peers could not dial it.
    - A download tries the peers of ``download_first_from`` first (an anchor: the training peers ahead of it), then
      takes the state in parts from the sharers at the highest epoch (up to STATE_PART_SOURCES of them, different
      tensors from each, ``rpc_download_state_part``), then hivemind's download from one sharer. A part whose peer
      fails or gives another epoch is asked of the others; failing that, the whole state comes from one peer.

    - A peer whose own state is not the swarm's (an anchor that only reduces: collab_kit.swarm.anchor) serves the state
      of the peers of ``serve_state_of`` instead (the training peers, behind NAT too), downloaded when asked and kept
      for ``proxy_max_age`` seconds, so that the parts a joiner asks at once come from one download
      (tests/swarm/test_keys_and_averagers.py::test_a_sharer_serves_the_state_of_the_peers_it_names).

    Shown by tests/netlab/test_network_lab.py::
    test_a_monitor_killed_and_started_again_with_the_same_command_loses_nothing and
    tests/swarm/test_keys_and_averagers.py::test_a_late_joiner_downloads_different_tensors_from_each_sharer.
    """

    _state_readers: frozenset = frozenset()  # in the averager's process: peers a client-mode peer serves its state to
    _state_sources: tuple = ()  # in the averager's process: peers to download from first
    _download_handler_added = False
    _proxy_sources: tuple = ()  # in the averager's process: peers whose state this one serves instead of its own
    _proxied: tuple | None = None  # in the averager's process: (time, state) of the last state downloaded to serve
    _proxied_parts: dict = {}  # in the averager's process: (part, count) -> (time, part) downloaded to serve
    _proxy_lock: asyncio.Lock | None = None
    proxy_max_age = 5.0  # seconds a state downloaded to serve is served again before it is downloaded anew

    def serve_state_to(self, peer_ids: Iterable[PeerID]) -> None:
        """Let ``peer_ids`` download this peer's state (in client mode; a peer that accepts connections shares its
        state with every peer anyway)."""
        self._outer_pipe.send(
            ("_set_state_readers", [], dict(peer_ids=tuple(peer_id.to_bytes() for peer_id in peer_ids)))
        )

    def download_first_from(self, peer_ids: Iterable[bytes]) -> None:
        """Try these peers (ids as bytes, the most promising first) before hivemind's sharers at the next download."""
        self._outer_pipe.send(("_set_state_sources", [], dict(peer_ids=tuple(peer_ids))))

    def serve_state_of(self, peer_ids: Iterable[bytes]) -> None:
        """Serve the state of ``peer_ids`` (ids as bytes, the most promising first; the first that gives one) instead of
        this peer's own; none: this peer's own again."""
        self._outer_pipe.send(("_set_proxy_sources", [], dict(peer_ids=tuple(peer_ids))))

    def served_state(self, timeout: float = 60.0) -> tuple[dict, list[torch.Tensor]] | None:
        """The state this peer serves now (metadata, tensors): with ``serve_state_of``, a source's (None when no source
        gives one), else its own."""
        future = MPFuture()
        self._outer_pipe.send(("_report_served_state", [], dict(future=future)))
        return future.result(timeout)

    @kept_until_done
    async def _set_proxy_sources(self, peer_ids: tuple) -> None:
        sources = tuple(PeerID(peer_id) for peer_id in peer_ids)
        if sources != self._proxy_sources:
            self._proxy_sources, self._proxied, self._proxied_parts = sources, None, {}

    @kept_until_done
    async def _report_served_state(self, future: MPFuture) -> None:
        try:
            metadata, tensors, _ = await self._get_current_state_from_host_process()
            future.set_result(
                (self.serializer.loads(metadata) if isinstance(metadata, bytes) else metadata, list(tensors))
            )
        except _NoStateToServe:
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)

    async def _get_current_state_from_host_process(self):
        """The state this peer serves (hivemind reads it here for each download): with ``serve_state_of``, the newest
        that a source gave within ``proxy_max_age`` seconds."""
        if not self._proxy_sources:
            return await super()._get_current_state_from_host_process()
        if self._proxy_lock is None:
            self._proxy_lock = asyncio.Lock()
        async with self._proxy_lock:  # the parts of one joiner, asked at once, come from one download
            if self._proxied is None or get_dht_time() - self._proxied[0] > self.proxy_max_age:
                state = await self._first_state_of(self._proxy_sources)
                if state is None:
                    raise _NoStateToServe("no peer of serve_state_of gave its state")
                self._proxied = (get_dht_time(), state)
        metadata, tensors = self._proxied[1]
        return self.serializer.dumps(metadata), tensors, None

    @kept_until_done
    async def _set_state_readers(self, peer_ids: tuple) -> None:
        self._state_readers = frozenset(PeerID(peer_id) for peer_id in peer_ids)
        if self.client_mode and not self._download_handler_added:
            # hivemind registers no handler in client mode; these alone, and they answer only _state_readers
            self._download_handler_added = True
            await self._p2p.add_protobuf_handler(
                self._get_handle_name(self.prefix, "rpc_download_state"),
                self.rpc_download_state,
                averaging_pb2.DownloadRequest,
                stream_output=True,
            )
            await self._p2p.add_protobuf_handler(
                self._get_handle_name(self.prefix, "rpc_download_state_part"),
                self.rpc_download_state_part,
                averaging_pb2.AveragingData,
                stream_output=True,
            )

    @kept_until_done
    async def _set_state_sources(self, peer_ids: tuple) -> None:
        self._state_sources = tuple(PeerID(peer_id) for peer_id in peer_ids)

    @property
    def allow_state_sharing(self) -> bool:
        return self.client_mode or super().allow_state_sharing  # in client mode, rpc_download_state chooses

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        DecentralizedAverager.allow_state_sharing.fset(self, value)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self.client_mode and context.remote_id not in self._state_readers:
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def rpc_download_state_part(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Part ``part`` of ``count`` of this peer's state (``request.group_id``: the pair, serialized): the metadata,
        with the indices of the tensors sent (``state_parts``) and their number, then those tensors as hivemind's
        rpc_download_state streams them. Nothing to a peer this one does not share its state with, or a bad request."""
        if not self.allow_state_sharing or (self.client_mode and context.remote_id not in self._state_readers):
            return
        try:
            part, count = self.serializer.loads(request.group_id)
            if not (isinstance(part, int) and isinstance(count, int) and 0 <= part < count <= STATE_PART_SOURCES):
                return
        except Exception:
            return
        if self._proxy_sources:  # only the part asked, relayed as it comes from a peer whose state this one serves
            async for message in self._relayed_part(part, count):
                yield message
            return
        metadata, tensors, infos = await self._get_current_state_from_host_process()
        if infos is None:
            infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
        indices = state_parts([tensor.numel() for tensor in tensors], count)[part]
        first = self.serializer.dumps(
            dict(
                state=self.serializer.loads(metadata) if isinstance(metadata, bytes) else metadata,
                indices=indices,
                tensors=len(tensors),
            )
        )
        yield averaging_pb2.DownloadData(metadata=first)
        for index in indices:
            compressed = self.state_compression.compress(tensors[index], infos[index], allow_inplace=False)
            for chunk in split_for_streaming(compressed):
                yield averaging_pb2.DownloadData(tensor_part=chunk)

    async def _relayed_part(self, part: int, count: int) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Part ``part`` of ``count`` of the state of a peer of ``serve_state_of`` (the first that gives it), passed
        on message by message as it arrives; kept ``proxy_max_age`` seconds for the next joiner. Nothing when no source
        gives it (the joiner asks another peer)."""
        if self._proxy_lock is None:
            self._proxy_lock = asyncio.Lock()
        async with self._proxy_lock:  # a second joiner waits, then gets the kept part
            kept = self._proxied_parts.get((part, count))
            if kept is not None and get_dht_time() - kept[0] <= self.proxy_max_age:
                for message in kept[1]:
                    yield message
                return
            request = averaging_pb2.AveragingData(group_id=self.serializer.dumps([part, count]))
            for peer in self._proxy_sources:
                messages = []
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state_part(request)
                    async for message in aiter_with_timeout(
                        stream, timeout=self.next_chunk_timeout or self.request_timeout
                    ):
                        messages.append(message)
                        yield message
                except Exception as e:  # gone or cut: what was passed on is incomplete, and the joiner asks elsewhere
                    logger.info(f"could not relay part {part} of the state of {peer}: {e!r}")
                    if messages:
                        return
                    continue
                if messages:
                    self._proxied_parts[(part, count)] = (get_dht_time(), messages)
                    return

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None):
        try:
            sources, self._state_sources = self._state_sources, ()
            state = await self._first_state_of(sources)
            if state is not None:
                future.set_result(state)
                return
            try:
                state = await self._download_state_in_parts()
            except Exception as e:  # hivemind's download from one peer is still there
                logger.info(f"could not download the state in parts: {e!r}")
                state = None
            if state is not None:
                future.set_result(state)
                return
            await super()._load_state_from_peers(future, timeout=timeout)
        finally:
            if not future.done():  # whatever ended the download (even a cancel), the trainer waiting on it goes on
                future.set_result(None)

    def _sharers_at_newest_epoch(self) -> list[PeerID]:
        """The peers sharing their state at the highest priority (hivemind's: their epoch), in random order."""
        found = self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers", latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        priorities = {
            PeerID(peer_id): float(info.value)
            for peer_id, info in entries.items()
            if isinstance(info, ValueWithExpiration)
            and isinstance(info.value, (int, float))
            and PeerID(peer_id) != self.peer_id
        }
        if not priorities:
            return []
        newest = max(priorities.values())
        sharers = [peer for peer, priority in priorities.items() if priority == newest]
        random.shuffle(sharers)  # many joiners at once spread over the sharers
        return sharers

    async def _download_state_in_parts(self) -> tuple[dict, list[torch.Tensor]] | None:
        """The state in parts from the sharers at the newest epoch, one part from each, all at once; a part whose peer
        failed, or gave another epoch than the first part's peer, is asked of the peers that gave theirs. None when
        fewer than two peers share, or a part could not be had."""
        sharers = self._sharers_at_newest_epoch()[:STATE_PART_SOURCES]
        if len(sharers) < 2:
            return None
        count, started = len(sharers), get_dht_time()
        results = await asyncio.gather(
            *(self._download_state_part(peer, part, count) for part, peer in enumerate(sharers)), return_exceptions=True
        )
        parts: dict[int, tuple[dict, dict[int, torch.Tensor]]] = {
            part: result for part, result in enumerate(results) if isinstance(result, tuple)
        }
        if not parts:
            return None
        reference = parts[min(parts)][0]
        parts = {
            part: got
            for part, got in parts.items()
            if got[0]["state"].get("epoch") == reference["state"].get("epoch")
            and got[0]["tensors"] == reference["tensors"]
        }
        givers = [sharers[part] for part in sorted(parts)]
        for part in range(count):
            for peer in givers:
                if part in parts:
                    break
                try:
                    got = await self._download_state_part(peer, part, count)
                except Exception as e:
                    logger.info(f"could not download part {part} of the state from {peer}: {e!r}")
                    continue
                if got[0]["state"].get("epoch") == reference["state"].get("epoch"):
                    parts[part] = got
            if part not in parts:
                return None
        tensors: dict[int, torch.Tensor] = {}
        for _, part_tensors in parts.values():
            tensors.update(part_tensors)
        if sorted(tensors) != list(range(reference["tensors"])):
            return None
        logger.info(f"downloaded the state in {count} parts from {count} peers in {get_dht_time() - started:.1f} s")
        return reference["state"], [tensors[index] for index in range(reference["tensors"])]

    async def _read_state_stream(self, stream) -> tuple[dict | None, list[torch.Tensor]]:
        """The metadata and the tensors of a state as hivemind's rpc_download_state streams them (a message with a
        tensor part of a dtype begins the next tensor), waiting at most a chunk's timeout for each message."""
        metadata: dict | None = None
        tensors: list[torch.Tensor] = []
        chunks: list[runtime_pb2.Tensor] = []
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout or self.request_timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if not message.tensor_part.buffer and not message.tensor_part.dtype:
                continue  # metadata alone
            if message.tensor_part.dtype and chunks:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(chunks)))
                chunks = []
            chunks.append(message.tensor_part)
        if chunks:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(chunks)))
        return metadata, tensors

    async def _download_state_part(self, peer: PeerID, part: int, count: int) -> tuple[dict, dict[int, torch.Tensor]]:
        """Part ``part`` of ``count`` of ``peer``'s state: (the part's metadata, its tensors by index)."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        request = averaging_pb2.AveragingData(group_id=self.serializer.dumps([part, count]))
        metadata, tensors = await self._read_state_stream(await stub.rpc_download_state_part(request))
        if not isinstance(metadata, dict) or not isinstance(metadata.get("state"), dict):
            raise ValueError(f"{peer} gave no part of its state")
        indices = metadata.get("indices")
        if (
            not isinstance(indices, list)
            or len(indices) != len(tensors)
            or not isinstance(metadata.get("tensors"), int)
        ):
            raise ValueError(f"{peer} gave a part that does not match its own description")
        return metadata, dict(zip(indices, tensors))

    async def _first_state_of(self, peers: Sequence[PeerID]) -> tuple[dict, list[torch.Tensor]] | None:
        """The state of the first of ``peers`` that gives one (a peer gone or cut: the next), or None."""
        for peer in peers:
            try:
                state = await self._download_state_from(peer)
            except Exception as e:  # gone, or cut: the next peer
                logger.info(f"could not download the state of {peer}: {e!r}")
                continue
            if state is not None:
                return state
        return None

    async def _download_state_from(self, peer: PeerID) -> tuple[dict, list[torch.Tensor]] | None:
        """``peer``'s state (metadata, tensors) by hivemind's download protocol, or None when it gives none."""
        started = get_dht_time()
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        metadata, tensors = await self._read_state_stream(
            await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        )
        if not metadata:
            return None
        logger.info(f"downloaded the state of {peer} in {get_dht_time() - started:.1f} s")
        return metadata, tensors
