"""What the cluster has told people about its nodes: the value of ``<prefix>_announced`` key ``nodes``.

The leading control plane keeps it (bucket ``Subjects.bucket_announced``) so that a node event judged
while no one led (a takeover's gap) is announced by the next leader, once: each leader compares this
with what it judges, not its own memory.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from llmgw_common.messages import Message

ANNOUNCED_NODES_KEY = "nodes"


class NodeTurn(StrEnum):
    """Which way a node went; the value is the event kind announcing it."""

    LOST = "node.lost"
    RECOVERED = "node.recovered"


class NodeAnnouncement(Message):
    """One node event a leader decided to announce: its time is the event's time and part of its id."""

    node: str
    turn: NodeTurn
    at: float


class AnnouncedNodes(Message):
    """``fence``: the lease revision of the leader that wrote it; a lower fence may not write over it.
    ``lost``: node -> when its ``node.lost`` was announced (nodes announced lost and not recovered).
    ``unsent``: announcements recorded but not yet known to be in the events stream (a leader that
    stopped between recording and publishing leaves them for the next one, which publishes them under
    the same ids, so the stream keeps one copy)."""

    fence: int = Field(ge=0)
    lost: dict[str, float] = Field(default_factory=dict)
    unsent: tuple[NodeAnnouncement, ...] = ()
