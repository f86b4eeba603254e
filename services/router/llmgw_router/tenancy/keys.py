"""The router's in-memory table of API keys, fed from the records in ``<prefix>_keys``.

A router follows the bucket and answers every check from memory, so a revoked or expired key stops
working within one watch event (and at worst one resync) on every router, with no bus call on the
request path. Minting and the bucket operations are in ``llmgw_runtime.apikeys``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmgw_common.codec import DecodeError, decode
from llmgw_common.messages import TEAM_KEY_PREFIX, ApiKeyRecord, TeamRecord
from llmgw_runtime.apikeys import hash_key


@dataclass(frozen=True, slots=True)
class KeyCheck:
    """Outcome of checking a presented key: the record, or why it was refused (HTTP 401)."""

    record: ApiKeyRecord | None
    problem: str | None = None


# Presented keys remembered with their record (hashing each request's key was a measurable part of
# the router's CPU per request); past this many the memo starts over.
MEMO_SIZE = 4096


class KeyTable:
    """hash -> record, fed from the bucket (or a static file). Reads are plain dict lookups."""

    def __init__(self, records: Iterable[ApiKeyRecord] = ()) -> None:
        self._by_id: dict[str, ApiKeyRecord] = {}
        self._by_hash: dict[str, ApiKeyRecord] = {}
        # Presented key -> its record, for keys that matched one. Emptied on every change to the table,
        # so a replaced (revoked) or removed record is never answered from it.
        self._memo: dict[str, ApiKeyRecord] = {}
        # Team name -> its record (key ``team.<name>`` in the bucket): limits shared by its keys.
        self.teams: dict[str, TeamRecord] = {}
        # One more on every change of a key or a team: the quota's meters are rebuilt when it moves.
        self.version = 0
        for r in records:
            self.put(r)

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, record: ApiKeyRecord) -> None:
        self._memo.clear()
        self.version += 1
        old = self._by_id.pop(record.id, None)
        if old is not None:
            self._by_hash.pop(old.hash, None)
        self._by_id[record.id] = record
        self._by_hash[record.hash] = record

    def by_id(self, key_id: str) -> ApiKeyRecord | None:
        return self._by_id.get(key_id)

    def put_team(self, team: TeamRecord) -> None:
        self.teams[team.name] = team
        self.version += 1

    def remove(self, key_id: str) -> None:
        self._memo.clear()
        self.version += 1
        old = self._by_id.pop(key_id, None)
        if old is not None:
            self._by_hash.pop(old.hash, None)

    def check(self, key: str | None, now: float) -> KeyCheck:
        if not key:
            return KeyCheck(None, "no API key: send 'Authorization: Bearer <key>'")
        rec = self._memo.get(key)
        if rec is None:
            try:
                digest = hash_key(key)
            except UnicodeEncodeError:
                # aiohttp hands over header bytes that are not UTF-8 as surrogates; no key has them.
                return KeyCheck(None, "invalid API key: it is not valid UTF-8")
            rec = self._by_hash.get(digest)
            if rec is None:
                return KeyCheck(None, "invalid API key")
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = rec
        if rec.revoked:
            return KeyCheck(None, f"API key {rec.name!r} was revoked")
        if rec.expires is not None and now >= rec.expires:
            return KeyCheck(None, f"API key {rec.name!r} has expired")
        return KeyCheck(rec)

    def on_kv_change(self, key: str, value: bytes | None, revision: int) -> None:
        """KvFollower callback: a record put, replaced or deleted. A bad value drops that key."""
        if key.startswith(TEAM_KEY_PREFIX):
            self._on_team(key[len(TEAM_KEY_PREFIX) :], value)
            return
        if value is None:
            self.remove(key)
            return
        try:
            rec = decode(value, ApiKeyRecord)
        except DecodeError:
            self.remove(key)
            raise
        if rec.id != key:
            rec = rec.model_copy(update={"id": key})
        self.put(rec)

    def _on_team(self, name: str, value: bytes | None) -> None:
        if value is None:
            self.teams.pop(name, None)
            self.version += 1
            return
        # A team whose record cannot be read keeps its last known limits (the DecodeError is the
        # follower's to log and retry): unreadable is not unlimited.
        team = decode(value, TeamRecord)
        self.put_team(team.model_copy(update={"name": name}) if team.name != name else team)


def allows_model(record: ApiKeyRecord | None, model: str) -> bool:
    return record is None or record.models is None or model in record.models
