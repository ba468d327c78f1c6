"""Prefix KV blocks: a prompt's keys and values in fixed-size blocks, found by what they hold, kept in three tiers.

A block holds `block_tokens` consecutive tokens' keys and values for every layer. Its id is a hash
of its tokens chained with the id of the block before it (and a namespace naming the model and
its weights), so equal ids mean equal prefixes: any request whose prompt starts with the same full
blocks finds them and prefills only the tokens after them. Blocks live in the device tier while it
has room; the least recently used move down to host memory, then to files in a local directory,
instead of being dropped, and a hit brings a block back to the device tier. Each tier has a budget
in bytes; past the disk tier's budget the oldest files are deleted. Blocks a hit brings up may hold a
tier above its budget until the engine settles the tiers, after the request's first token.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from baige_ray.api.validation import require_int
from baige_ray.models.generation import KV

TIERS = ("device", "host", "disk")


@dataclass(kw_only=True, frozen=True)
class KVCacheConfig:
    """Prefix caching of the built-in engine: block size in tokens and a budget in bytes per tier
    (0 turns a tier off; `device_bytes=0` turns prefix caching off). The disk tier needs `disk_dir`."""

    block_tokens: int = 16
    device_bytes: int = 256 << 20
    host_bytes: int = 1 << 30
    disk_bytes: int = 0
    disk_dir: str | None = None

    def __post_init__(self) -> None:
        require_int("KVCacheConfig", "block_tokens", self.block_tokens, minimum=1)
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            require_int("KVCacheConfig", name, getattr(self, name), minimum=0)
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("KVCacheConfig.disk_dir is required when disk_bytes > 0 (a local directory for KV blocks)")

    @property
    def enabled(self) -> bool:
        return self.device_bytes > 0


def block_ids(tokens: Sequence[int], block_tokens: int, namespace: str) -> list[str]:
    """The id of every full block of `tokens`: each hashes its tokens and the id before it."""
    ids, previous = [], hashlib.sha256(namespace.encode()).hexdigest()
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        chunk = struct.pack(f"<{block_tokens}q", *tokens[start:start + block_tokens])
        previous = hashlib.sha256(previous.encode() + chunk).hexdigest()
        ids.append(previous)
    return ids


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy())  # the bytes in place, no copy
    return digest.hexdigest()


def block_bytes(block: KV) -> int:
    return sum(t.numel() * t.element_size() for layer in block for t in layer)


def slice_blocks(cache: KV, first: int, count: int, block_tokens: int) -> list[KV]:
    """Blocks `first` .. `first + count - 1` of a batch-1 cache, each its own copy (a block must not
    keep the whole cache alive)."""
    return [[(keys[:, :, start:start + block_tokens].clone(), values[:, :, start:start + block_tokens].clone())
             for keys, values in cache]
            for start in range(first * block_tokens, (first + count) * block_tokens, block_tokens)]


def join_blocks(blocks: Sequence[KV]) -> KV:
    """One batch-1 cache holding `blocks` in order."""
    return [(torch.cat([block[layer][0] for block in blocks], dim=2), torch.cat([block[layer][1] for block in blocks], dim=2))
            for layer in range(len(blocks[0]))]


@dataclass
class CacheStats:
    """Blocks found per tier, blocks looked for and not found, blocks stored, and bytes moved between tiers
    ('device->host', 'host->disk', 'host->device', 'disk->device'), blocks dropped for good."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: int = 0
    stored: int = 0
    moved_bytes: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    handed_over: int = 0  # blocks given to a peer when this replica stopped
    adopted: int = 0  # blocks a stopping peer gave this replica

    def moved(self, source: str, target: str, size: int) -> None:
        key = f"{source}->{target}"
        self.moved_bytes[key] = self.moved_bytes.get(key, 0) + size

    def as_dict(self) -> dict:
        return {"hits": dict(self.hits), "misses": self.misses, "stored": self.stored,
                "moved_bytes": dict(self.moved_bytes), "dropped": self.dropped, "handed_over": self.handed_over,
                "adopted": self.adopted}


@dataclass(frozen=True)
class BlockHandover:
    """Blocks a stopping replica gives a peer; `departed` names the giver for the router's index."""

    namespace: str  # the model and weights the blocks were made with
    ids: list[str]
    blocks: list[KV]
    departed: str = ""


class PrefixBlockStore:
    """Blocks by id in the device, host and disk tiers, each in least-recently-used order."""

    def __init__(self, config: KVCacheConfig, device: torch.device, namespace: str):
        self.config, self.device, self.namespace = config, torch.device(device), namespace
        self._memory: dict[str, OrderedDict[str, KV]] = {"device": OrderedDict(), "host": OrderedDict()}
        self._disk: OrderedDict[str, int] = OrderedDict()  # id -> file bytes
        self._used = dict.fromkeys(TIERS, 0)
        self.stats = CacheStats()
        if config.disk_bytes:
            # Files left by an earlier store are not in this one's index (it lives in memory): remove them.
            Path(config.disk_dir).mkdir(parents=True, exist_ok=True)
            for stale in Path(config.disk_dir).glob("*.safetensors"):
                stale.unlink(missing_ok=True)

    # ---- what requests ask ----------------------------------------------------------------------

    def ids(self, tokens: Sequence[int]) -> list[str]:
        return block_ids(tokens, self.config.block_tokens, self.namespace)

    def take(self, ids: Sequence[str]) -> list[KV]:
        """The leading blocks of `ids` that are cached, on the device, each now the most recent. A block
        whose file cannot be read any more ends the prefix there (it is forgotten; the caller prefills)."""
        blocks = []
        for block_id in ids:
            tier = self.tier_of(block_id)
            if tier is None:
                break
            try:
                block = self._pop(tier, block_id)
            except (OSError, KeyError, ValueError, SafetensorError):  # a disk block deleted or damaged since
                self._forget_file(block_id)
                break
            self.stats.hits[tier] += 1
            if tier != "device":
                self.stats.moved(tier, "device", block_bytes(block))
            blocks.append(self._to(block, self.device))
            self._put_memory("device", block_id, blocks[-1])
        return blocks  # the tiers settle later (`settle`): moving blocks down must not delay the first token

    def count_misses(self, count: int) -> None:
        self.stats.misses += count

    def cached_prefix(self, prompt: Sequence[int], limit: int | None = None) -> tuple[KV | None, int]:
        """The cached keys and values of the prompt's leading full blocks (at most `limit` tokens' worth),
        and how many tokens they hold; never the last token (its logits give the first new token)."""
        usable = self._reusable_tokens(prompt) if limit is None else min(limit, self._reusable_tokens(prompt))
        wanted = self.ids(prompt[:usable])
        blocks = self.take(wanted)
        self.count_misses(len(wanted) - len(blocks))
        return (join_blocks(blocks), len(blocks) * self.config.block_tokens) if blocks else (None, 0)

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` (the last excepted) the tiers hold, without taking them.
        Safe from another thread than the engine's: it only tests membership; the engine takes them later
        and copes with a block gone meanwhile."""
        held = 0
        for block_id in self.ids(prompt[:self._reusable_tokens(prompt)]):
            if self.tier_of(block_id) is None:
                break
            held += self.config.block_tokens
        return held

    def _reusable_tokens(self, prompt: Sequence[int]) -> int:
        """The full blocks' tokens of `prompt` without its last token (whose logits give the first new one)."""
        return (len(prompt) - 1) // self.config.block_tokens * self.config.block_tokens

    def keep_tokens(self, tokens: Sequence[int], cache: KV) -> None:
        """Keep the full blocks of `tokens` (whose keys and values the batch-1 `cache` holds) not kept yet."""
        ids = self.ids(tokens)
        new = [index for index, block_id in enumerate(ids) if self.tier_of(block_id) is None]
        if new:
            first = new[0]
            self.put(ids[first:], slice_blocks(cache, first, len(ids) - first, self.config.block_tokens))

    def put(self, ids: Sequence[str], blocks: Sequence[KV]) -> None:
        """Keep `blocks` under `ids` in the device tier (an id already kept only becomes the most recent)."""
        for block_id, block in zip(ids, blocks):
            tier = self.tier_of(block_id)
            if tier == "device":
                self._memory["device"].move_to_end(block_id)
                continue
            if tier is not None:
                self._pop(tier, block_id)
            self.stats.stored += 1
            self._put_memory("device", block_id, block)
        self.settle()

    def hottest(self, max_bytes: int) -> BlockHandover:
        """The most recently used blocks of the memory tiers (device first), on the host, up to `max_bytes`:
        what a replica that stops hands a peer (the disk tier's files stay: a peer could not read them)."""
        chosen, size = [], 0
        newest_first = [(i, self._memory[tier][i]) for tier in ("device", "host") for i in reversed(self._memory[tier])]
        for block_id, block in newest_first:
            if size + block_bytes(block) > max_bytes:
                break
            chosen.append((block_id, self._to(block, torch.device("cpu"))))
            size += block_bytes(block)
        self.stats.handed_over += len(chosen)
        chosen.reverse()  # coldest first: adopted in this order, the hottest end up the most recent
        return BlockHandover(namespace=self.namespace, ids=[i for i, _ in chosen], blocks=[b for _, b in chosen])

    def adopt(self, handover: BlockHandover) -> int:
        """Keep a stopping peer's blocks (made under the same model and weights, else none); how many."""
        if handover.namespace != self.namespace:
            return 0
        self.put(handover.ids, [self._to(block, self.device) for block in handover.blocks])
        self.stats.adopted += len(handover.ids)
        return len(handover.ids)

    def tier_of(self, block_id: str) -> str | None:
        if block_id in self._memory["device"]:
            return "device"
        if block_id in self._memory["host"]:
            return "host"
        return "disk" if block_id in self._disk else None

    def used_bytes(self) -> dict[str, int]:
        return dict(self._used)

    def num_blocks(self) -> dict[str, int]:
        return {"device": len(self._memory["device"]), "host": len(self._memory["host"]), "disk": len(self._disk)}

    def report(self) -> dict:
        """What /health shows: blocks and bytes per tier, hits per tier, misses, bytes moved between tiers."""
        return {"block_tokens": self.config.block_tokens, "blocks": self.num_blocks(), "used_bytes": self.used_bytes(),
                **self.stats.as_dict()}

    # ---- tiers ----------------------------------------------------------------------------------

    def _put_memory(self, tier: str, block_id: str, block: KV) -> None:
        self._memory[tier][block_id] = block
        self._used[tier] += block_bytes(block)

    def _pop(self, tier: str, block_id: str) -> KV:
        if tier == "disk":
            return self._read_file(block_id)
        block = self._memory[tier].pop(block_id)
        self._used[tier] -= block_bytes(block)
        return block

    def settle(self) -> None:
        """Move least-recently-used blocks down until every tier is within its budget (after `take`)."""
        while self._used["device"] > self.config.device_bytes and self._memory["device"]:
            self._demote("device")
        while self._used["host"] > self.config.host_bytes and self._memory["host"]:
            self._demote("host")
        while self._used["disk"] > self.config.disk_bytes and self._disk:
            self._remove_file(next(iter(self._disk)))
            self.stats.dropped += 1

    def _demote(self, source: str) -> None:
        """The least recently used block of `source` to the next tier below with room for a block, if any."""
        block_id = next(iter(self._memory[source]))
        block = self._pop(source, block_id)
        size = block_bytes(block)
        budgets = {"host": self.config.host_bytes, "disk": self.config.disk_bytes}
        target = next((t for t in TIERS[TIERS.index(source) + 1:] if budgets[t] >= size), None)
        if target is None:
            self.stats.dropped += 1
            return
        self.stats.moved(source, target, size)
        if target == "host":
            self._put_memory("host", block_id, self._to(block, torch.device("cpu")))
        else:
            self._write_file(block_id, block)

    @staticmethod
    def _to(block: KV, device: torch.device) -> KV:
        return [(keys.to(device), values.to(device)) for keys, values in block]

    # ---- the disk tier: safetensors files (no pickle) -------------------------------------------

    def _path(self, block_id: str) -> Path:
        return Path(self.config.disk_dir) / f"{block_id}.safetensors"

    def _write_file(self, block_id: str, block: KV) -> None:
        from safetensors.torch import save_file

        tensors = {f"{kind}{layer}": tensor.contiguous().cpu()
                   for layer, pair in enumerate(block) for kind, tensor in zip("kv", pair)}
        path = self._path(block_id)
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial), metadata={"sha256": _checksum(tensors)})
        os.replace(partial, path)  # a reader never sees half a block
        size = path.stat().st_size
        self._disk[block_id] = size
        self._used["disk"] += size

    def _read_file(self, block_id: str) -> KV:
        """The block in its file, checked against the checksum written with it (ValueError if it differs)."""
        from safetensors import safe_open

        with safe_open(str(self._path(block_id)), framework="pt") as handle:
            expected = (handle.metadata() or {}).get("sha256")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        if expected is None or _checksum(tensors) != expected:
            raise ValueError(f"KV block {block_id[:12]}'s file does not match its checksum")
        self._remove_file(block_id)
        return [(tensors[f"k{layer}"], tensors[f"v{layer}"]) for layer in range(len(tensors) // 2)]

    def _remove_file(self, block_id: str) -> None:
        self._used["disk"] -= self._disk.pop(block_id)
        self._path(block_id).unlink(missing_ok=True)

    def _forget_file(self, block_id: str) -> None:
        if block_id in self._disk:
            self._remove_file(block_id)
            self.stats.dropped += 1
