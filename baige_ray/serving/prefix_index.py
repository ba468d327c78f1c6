"""Which replica holds which prompt prefixes: the index the prefix-aware router consults (pure, no Ray).

The router sees requests before any replica tokenizes them, so the index works on text: a prompt is
cut into blocks of `block_chars` characters and each block is named by a hash chained over every
block before it (as the replicas' KV blocks are over tokens), so equal ids mean equal prefixes. A
request routed to a replica is recorded as held there; what a replica's own cache later lets go of
is forgotten here in the same least-recently-used order, by a bound on the blocks kept per replica.
A replica that stops hands its hottest blocks to a peer: its entries wait (`keep_only` retires them,
the newest few stopped replicas' at most) until `transfer` credits them to the peer that took them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from baige_ray.api.validation import require_int

DEFAULT_BLOCK_CHARS = 64
DEFAULT_BLOCKS_PER_REPLICA = 65536  # 4 MiB of prompt text per replica at 64 characters a block
MAX_RETIRED = 4  # stopped replicas whose entries wait for their hand-over


def text_block_ids(text: str, block_chars: int = DEFAULT_BLOCK_CHARS) -> list[bytes]:
    """The chained id of every full block of `text`."""
    ids, previous = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start:start + block_chars].encode(), digest_size=12).digest()
        ids.append(previous)
    return ids


class PrefixIndex:
    """Block ids per replica, each replica's in least-recently-used order, at most `blocks_per_replica`."""

    def __init__(self, blocks_per_replica: int = DEFAULT_BLOCKS_PER_REPLICA):
        require_int("PrefixIndex", "blocks_per_replica", blocks_per_replica, minimum=1)
        self.blocks_per_replica = blocks_per_replica
        self._by_replica: dict[str, OrderedDict[bytes, None]] = {}
        self._holders: dict[bytes, set[str]] = {}
        self._retired: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()

    def matched_blocks(self, ids: Sequence[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """For each of `replicas`, how many leading blocks of `ids` it holds."""
        counts = dict.fromkeys(replicas, 0)
        running = set(counts)
        for position, block_id in enumerate(ids):
            running &= self._holders.get(block_id, set())
            if not running:
                break
            for replica in running:
                counts[replica] = position + 1
        return counts

    def record(self, ids: Sequence[bytes], replica: str) -> None:
        """`replica` now holds the blocks `ids` (most recently used)."""
        held = self._by_replica.setdefault(replica, OrderedDict())
        for block_id in ids:
            if block_id in held:
                held.move_to_end(block_id)
            else:
                held[block_id] = None
                self._holders.setdefault(block_id, set()).add(replica)
        while len(held) > self.blocks_per_replica:
            self._forget(replica, held.popitem(last=False)[0])

    def keep_only(self, replicas: Iterable[str]) -> None:
        """Retire every replica not in `replicas` (stopped, lent back to training, dead): nothing is routed
        to it, and its entries wait for a `transfer`."""
        for replica in sorted(set(self._by_replica) - set(replicas)):
            held = self._by_replica.pop(replica)
            for block_id in held:
                self._forget(replica, block_id)
            self._retired[replica] = held
            while len(self._retired) > MAX_RETIRED:
                self._retired.popitem(last=False)

    def transfer(self, departed: str, heir: str) -> int:
        """`heir` took `departed`'s blocks as it stopped: its retired entries become the heir's; how many."""
        held = self._retired.pop(departed, None)
        if held is None:
            return 0
        self.record(list(held), heir)
        return len(held)

    def num_blocks(self, replica: str) -> int:
        return len(self._by_replica.get(replica, ()))

    def _forget(self, replica: str, block_id: bytes) -> None:
        holders = self._holders.get(block_id)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_id]
