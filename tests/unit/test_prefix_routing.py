"""Cache-aware routing's pure parts: the prefix index, the routing policy, the text a request is routed on."""

from __future__ import annotations

import json

import pytest

from baige_ray.policies.prefix_routing import RoutingObservation, choose_replicas
from baige_ray.serving.prefix_index import PrefixIndex, text_block_ids
from baige_ray.serving.prefix_router import routing_text

pytestmark = pytest.mark.unit

SYSTEM = "You answer questions about the standard library, briefly and exactly. " * 2


def test_block_ids_chain_over_the_prefix():
    first, second = text_block_ids(SYSTEM + "Question one?", 16), text_block_ids(SYSTEM + "Another question!", 16)
    shared = len(SYSTEM) // 16
    assert first[:shared] == second[:shared] and first[shared] != second[shared]
    # The same block text after another prefix is another block.
    assert text_block_ids("x" * 16 + SYSTEM[:16], 16)[1] != text_block_ids(SYSTEM[:16], 16)[0]
    assert text_block_ids("short", 16) == []


def test_the_index_counts_leading_blocks_held_per_replica():
    index = PrefixIndex()
    chat = text_block_ids(SYSTEM + "turn one", 8)
    index.record(chat[:4], "a")
    index.record(chat, "b")
    index.record(chat[1:], "c")  # holds later blocks only: no leading match
    assert index.matched_blocks(chat, ["a", "b", "c", "d"]) == {"a": 4, "b": len(chat), "c": 0, "d": 0}


def test_the_index_forgets_least_recently_used_blocks_and_gone_replicas():
    index = PrefixIndex(blocks_per_replica=4)
    old, new = text_block_ids("o" * 64, 16), text_block_ids("n" * 48, 16)
    index.record(old, "a")
    index.record(old[:1], "a")  # used again: the most recent
    index.record(new, "a")  # 3 new blocks push out 3 least recently used
    assert index.num_blocks("a") == 4
    assert index.matched_blocks(old, ["a"]) == {"a": 1} and index.matched_blocks(new, ["a"]) == {"a": 3}
    index.record(new, "b")
    index.keep_only(["b"])
    assert index.matched_blocks(new, ["a", "b"]) == {"a": 0, "b": 3} and index.num_blocks("a") == 0


def _decide(matched, queues, margin=4):
    return choose_replicas(RoutingObservation(matched_blocks=matched, queue_lengths=queues, overload_margin=margin))


def test_the_longest_cached_prefix_goes_first_with_everyone_after():
    decision = _decide({"a": 2, "b": 7}, {"a": 0, "b": 3})
    assert decision.reason == "prefix" and decision.ranks == (("b",), ("a", "b"))


def test_an_overloaded_holder_gives_way_to_the_least_loaded():
    decision = _decide({"a": 0, "b": 7, "c": 1}, {"a": 1, "b": 5, "c": 1})
    assert decision.reason == "overloaded" and decision.ranks[0] == ("a", "c")
    assert _decide({"a": 0, "b": 7}, {"a": 1, "b": 4}).reason == "prefix"  # 3 more queued: under the margin


def test_no_match_goes_to_the_least_loaded_and_unknown_queues_are_not_judged():
    assert _decide({}, {"a": 2, "b": 0}).ranks[0] == ("b",)
    assert _decide({}, {"a": None, "b": None}).ranks[0] == ("a", "b")
    assert _decide({"a": 3}, {"a": None, "b": 0}, margin=1).reason == "prefix"
    assert _decide({}, {}).ranks == ()


@pytest.mark.parametrize(("payload", "expected"), [
    ({"prompt": "hello there"}, "hello there"),
    ({"prompt": ["first", "second"]}, "first"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
     "<system>be brief<user>hi"),
    ({"prompt": 3}, ""),
    ({}, ""),
])
def test_the_text_a_request_is_routed_on(payload, expected):
    assert routing_text(json.dumps(payload).encode()) == expected


def test_a_malformed_body_is_routed_on_nothing():
    assert routing_text(b"{not json") == "" and routing_text(b"[1, 2]") == "" and routing_text(b"\xff") == ""


def test_the_routing_benchs_workload_shares_system_prompts_and_gives_each_chat_its_own():
    from baige_ray.bench.prefix_routing import text_workload

    corpus = "".join(chr(ord("a") + i % 26) * (1 + i % 7) for i in range(2000))
    sessions = text_workload(corpus, seed=3, systems=2, shared_requests=4, chats=2, turns=3, system_chars=40,
                             user_chars=8)
    assert sessions == text_workload(corpus, seed=3, systems=2, shared_requests=4, chats=2, turns=3,
                                     system_chars=40, user_chars=8)
    shared, chats = sessions[0::2][:2] + sessions[4:], [sessions[1], sessions[3]]
    assert [len(s.messages) for s in chats] == [3, 3] and chats[0].system != chats[1].system
    assert len({s.system for s in shared}) == 2 and all(len(s.messages) == 1 for s in shared)
    assert all(len(s.system) == 40 and all(len(m) == 8 for m in s.messages) for s in sessions)


def test_a_stopped_replicas_prefixes_are_credited_to_the_peer_that_took_its_blocks():
    from baige_ray.policies.prefix_routing import choose_heir

    index = PrefixIndex()
    chat = text_block_ids(SYSTEM, 8)
    index.record(chat, "a")
    index.record(chat[:2], "b")
    index.keep_only(["b", "c"])  # a stopped: nothing is routed to it
    assert index.matched_blocks(chat, ["a", "b", "c"]) == {"a": 0, "b": 2, "c": 0}
    assert choose_heir({"b": index.num_blocks("b"), "c": index.num_blocks("c")}) == (("c",), ("b", "c"))
    assert index.transfer("a", "c") == len(chat) and index.transfer("a", "c") == 0
    assert index.matched_blocks(chat, ["b", "c"]) == {"b": 2, "c": len(chat)}
    assert choose_heir({}) == ()
