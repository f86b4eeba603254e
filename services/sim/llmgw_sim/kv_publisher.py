"""The simulated engine's KV-event publisher: a ZMQ PUB socket, as vLLM's ``ZmqEventPublisher``.

vLLM binds an ``ipc://`` (or wildcard ``tcp://``) endpoint and sends each engine step's events as one
message of three frames: the topic, the batch's sequence number (8 bytes big-endian, from 0, one
more per message) and the msgpack batch ``[ts, [events], dp_rank]``
(:func:`llmgw_common.vllm_kv_events.encode_frames`). A step without events sends nothing. The
simulator sends one batch per request's prefill and one per its end, from the event loop: a PUB
socket never blocks (past its high-water mark it drops, as vLLM's does), so no thread is needed.
vLLM's replay socket is not simulated.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from llmgw_common.vllm_kv_events import EventBatch, KvEvent, encode_frames

# vLLM's default high-water mark for its PUB socket.
HWM = 100_000


class KvEventPublisher:
    def __init__(self, endpoint: str, topic: str, dp_rank: int = 0) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.dp_rank = dp_rank
        self.seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            # An OSError: what a server that cannot bind raises, and the CLI reports.
            raise OSError(f"cannot bind the KV-event socket at {endpoint}: {e}") from e

    def publish(self, events: Sequence[KvEvent], ts: float) -> None:
        """Send one batch (nothing when there are no events)."""
        if not events:
            return
        frames = encode_frames(self.topic, self.seq, EventBatch(ts, tuple(events), self.dp_rank))
        self.seq += 1
        self._sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
