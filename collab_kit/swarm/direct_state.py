"""States passed between the peers a trainer names, beside hivemind's rule that only peers accepting connections
share theirs: the way an anchor started again takes the newest state from the volunteers behind NAT."""
from __future__ import annotations

import logging
from typing import AsyncIterator, Iterable, List, Optional, Tuple

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

logger = logging.getLogger(__name__)


class DirectStateMixin:
    """Put before TrainingStateAverager: states pass between the peers a trainer names, beside hivemind's rule (only
    peers that accept connections share their state, found through the DHT).

    - A peer in client mode serves its state to the peers of ``serve_state_to`` (the run's anchors, its initial
      peers): nobody can dial it, but a connection it opened carries streams both ways, so an anchor started again
      can take the newest state from the volunteers behind NAT that reconnected to it. It is never announced in the
      DHT: other peers could not dial it.
    - A download tries the peers of ``download_first_from`` first (an anchor: the training peers ahead of it), then
      hivemind's sharers.

    Shown by tests/netlab/test_network_lab.py::
    test_a_monitor_killed_and_started_again_with_the_same_command_loses_nothing.
    """

    _state_readers: frozenset = frozenset()  # in the averager's process: peers a client-mode peer serves its state to
    _state_sources: tuple = ()  # in the averager's process: peers to download from first
    _download_handler_added = False

    def serve_state_to(self, peer_ids: Iterable[PeerID]) -> None:
        """Let ``peer_ids`` download this peer's state (in client mode; a peer that accepts connections shares its
        state with every peer anyway)."""
        self._outer_pipe.send(("_set_state_readers", [], dict(peer_ids=tuple(peer_id.to_bytes() for peer_id in
                                                                                  peer_ids))))

    def download_first_from(self, peer_ids: Iterable[bytes]) -> None:
        """Try these peers (ids as bytes, the most promising first) before hivemind's sharers at the next download."""
        self._outer_pipe.send(("_set_state_sources", [], dict(peer_ids=tuple(peer_ids))))

    async def _set_state_readers(self, peer_ids: tuple) -> None:
        self._state_readers = frozenset(PeerID(peer_id) for peer_id in peer_ids)
        if self.client_mode and not self._download_handler_added:
            # hivemind registers no handler in client mode; this one alone, and it answers only _state_readers
            self._download_handler_added = True
            await self._p2p.add_protobuf_handler(self._get_handle_name(self.prefix, "rpc_download_state"),
                                                 self.rpc_download_state, averaging_pb2.DownloadRequest,
                                                 stream_output=True)

    async def _set_state_sources(self, peer_ids: tuple) -> None:
        self._state_sources = tuple(PeerID(peer_id) for peer_id in peer_ids)

    @property
    def allow_state_sharing(self) -> bool:
        return self.client_mode or super().allow_state_sharing  # in client mode, rpc_download_state chooses

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        DecentralizedAverager.allow_state_sharing.fset(self, value)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self.client_mode and context.remote_id not in self._state_readers:
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None):
        sources, self._state_sources = self._state_sources, ()
        for peer in sources:
            try:
                state = await self._download_state_from(peer)
            except Exception as e:  # gone, or cut: the next source
                logger.info(f"could not download the state of {peer}: {e!r}")
                continue
            if state is not None:
                future.set_result(state)
                return
        await super()._load_state_from_peers(future, timeout=timeout)

    async def _download_state_from(self, peer: PeerID) -> Optional[Tuple[dict, List[torch.Tensor]]]:
        """``peer``'s state (metadata, tensors) by hivemind's download protocol, or None when it gives none."""
        started = get_dht_time()
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, tensors, parts = None, [], []
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout or self.request_timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a part with a dtype begins the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not metadata:
            return None
        logger.info(f"downloaded the state of {peer} in {get_dht_time() - started:.1f} s")
        return metadata, tensors
