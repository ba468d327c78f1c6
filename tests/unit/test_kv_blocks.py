"""Prefix KV blocks (serving/kv_blocks.py): ids chained over the prefix, three tiers in LRU order with
byte budgets, and the engine prefilling only what its cache lacks while getting the same tokens."""

from __future__ import annotations

import pytest
import torch

from baige_ray.models.hf.decoding import HFDecoder
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all
from baige_ray.serving.kv_blocks import KVCacheConfig, PrefixBlockStore, block_bytes, block_ids
from tests.hf_helpers import VOCAB_SIZE, llama_config, qwen2_tied_config

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 4


def _block(value: float):
    return [(torch.full((1, HEADS, BLOCK, HEAD_DIM), value), torch.full((1, HEADS, BLOCK, HEAD_DIM), -value))
            for _ in range(LAYERS)]


BLOCK_BYTES = block_bytes(_block(0.0))  # 256 bytes


def _store(tmp_path, device_blocks: int, host_blocks: int, disk_blocks: int) -> PrefixBlockStore:
    # a file holds a little more than the tensors (safetensors' header and the checksum: 360 bytes here)
    config = KVCacheConfig(block_tokens=BLOCK, device_bytes=device_blocks * BLOCK_BYTES,
                           host_bytes=host_blocks * BLOCK_BYTES, disk_bytes=disk_blocks * (BLOCK_BYTES + 400),
                           disk_dir=str(tmp_path / "kv"))
    return PrefixBlockStore(config, torch.device("cpu"), namespace="model-v1")


def test_a_block_id_names_its_tokens_and_everything_before_them():
    shared, other = list(range(8)), [99] + list(range(1, 8))
    assert block_ids(shared + [1, 2, 3, 4, 5], 4, "m") == block_ids(shared + [1, 2, 3, 4], 4, "m")  # full blocks only
    assert block_ids(shared, 4, "m")[:1] != block_ids(other, 4, "m")[:1]
    assert block_ids(shared, 4, "m")[1] != block_ids(other, 4, "m")[1]  # same tokens, another prefix
    assert block_ids(shared, 4, "m") != block_ids(shared, 4, "m-v2")  # other weights


def test_blocks_move_down_the_tiers_in_lru_order_and_come_back_on_a_hit(tmp_path):
    store = _store(tmp_path, device_blocks=2, host_blocks=2, disk_blocks=2)
    ids = [f"{i:064x}" for i in range(7)]
    for index, block_id in enumerate(ids):
        store.put([block_id], [_block(float(index))])
    assert store.num_blocks() == {"device": 2, "host": 2, "disk": 2}  # the oldest block was dropped
    assert [store.tier_of(i) for i in ids] == [None, "disk", "disk", "host", "host", "device", "device"]
    assert store.stats.dropped == 1 and store.used_bytes()["device"] == 2 * BLOCK_BYTES
    (block,) = store.take([ids[1]])  # read back from its file, exactly
    store.settle()
    assert torch.equal(block[1][1], torch.full((1, HEADS, BLOCK, HEAD_DIM), -1.0))
    assert store.tier_of(ids[1]) == "device" and store.tier_of(ids[5]) == "host"
    assert store.stats.hits == {"device": 0, "host": 0, "disk": 1}
    assert store.stats.moved_bytes["disk->device"] == BLOCK_BYTES
    assert store.stats.moved_bytes["device->host"] == 6 * BLOCK_BYTES  # five while filling, one for the hit
    assert len(list((tmp_path / "kv").glob("*.safetensors"))) == store.num_blocks()["disk"]


def test_a_damaged_block_file_ends_the_cached_prefix_instead_of_failing(tmp_path):
    store = _store(tmp_path, device_blocks=1, host_blocks=0, disk_blocks=4)
    ids = [f"{i:064x}" for i in range(3)]
    store.put(ids, [_block(1.0), _block(2.0), _block(3.0)])
    assert [store.tier_of(i) for i in ids] == ["disk", "disk", "device"]
    (tmp_path / "kv" / f"{ids[1]}.safetensors").write_bytes(b"not a tensor file")
    assert len(store.take(ids)) == 1  # the first block, then the damaged one stops it
    assert store.tier_of(ids[1]) is None


def test_a_block_whose_bytes_changed_on_disk_fails_its_checksum_and_is_recomputed_not_served(tmp_path):
    store = _store(tmp_path, device_blocks=1, host_blocks=0, disk_blocks=4)
    ids = [f"{i:064x}" for i in range(2)]
    store.put(ids, [_block(1.0), _block(2.0)])
    path = tmp_path / "kv" / f"{ids[0]}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # one bit of the last value: the file still parses
    path.write_bytes(bytes(data))
    assert store.take(ids) == [] and store.tier_of(ids[0]) is None and store.stats.dropped == 1


def test_invalid_cache_configs_name_the_field():
    with pytest.raises(ValueError, match="block_tokens"):
        KVCacheConfig(block_tokens=0)
    with pytest.raises(ValueError, match="disk_dir"):
        KVCacheConfig(disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="host_bytes"):
        KVCacheConfig(host_bytes=-1)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()


def _gpt_decoder():
    from baige_ray.models.gpt import GPT, GPTConfig
    from baige_ray.models.gpt_decoding import GPTDecoder

    torch.manual_seed(0)
    return GPTDecoder(GPT(GPTConfig(seq_len=96, num_layers=2, num_heads=2, hidden=32)).eval())


def _engine(decoder, store=None) -> ContinuousBatchingEngine:
    return ContinuousBatchingEngine(decoder, eos_token_id=None, limits=EngineLimits(max_batch_size=3), prefixes=store)


def _qwen2_tied_decoder():  # tied embeddings and QKV biases, as Qwen2.5-0.5B has
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return HFDecoder(AutoModelForCausalLM.from_config(qwen2_tied_config(), dtype=torch.float32).eval(), 128)


@pytest.mark.parametrize("model", ["llama", "qwen2-tied", "gpt"])
def test_prompts_sharing_a_system_prompt_prefill_only_their_own_tokens_and_get_the_same_tokens(llama, model):
    decoder, vocab = {"llama": lambda: (HFDecoder(llama, 128), VOCAB_SIZE),
                      "qwen2-tied": lambda: (_qwen2_tied_decoder(), VOCAB_SIZE),
                      "gpt": lambda: (_gpt_decoder(), 256)}[model]()
    generator = torch.Generator().manual_seed(3)
    system = torch.randint(0, vocab, (40,), generator=generator).tolist()
    prompts = [system + torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 9, 2, 13)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0), SamplingParams(max_new_tokens=9, temperature=0.8, seed=5),
              SamplingParams(max_new_tokens=15, temperature=0.0), SamplingParams(max_new_tokens=7, temperature=1.0, seed=9)]
    expected = generate_all(_engine(decoder), prompts, params)
    store = PrefixBlockStore(KVCacheConfig(block_tokens=8, device_bytes=1 << 20, host_bytes=0), torch.device("cpu"),
                             namespace=f"tiny-{model}-v0")
    engine = _engine(decoder, store)
    assert generate_all(engine, prompts[:1], params[:1]) == expected[:1]
    assert generate_all(engine, prompts[1:], params[1:]) == expected[1:]  # three at once, joining the batch
    assert store.stats.hits["device"] == 3 * 5  # the system prompt's 5 full blocks, for each later prompt


def test_the_next_turn_of_a_chat_reuses_the_answer_of_the_turn_before(llama, tmp_path):
    generator = torch.Generator().manual_seed(4)
    first = torch.randint(0, VOCAB_SIZE, (21,), generator=generator).tolist()
    config = KVCacheConfig(block_tokens=8, device_bytes=1 << 20, host_bytes=0)
    store = PrefixBlockStore(config, torch.device("cpu"), namespace="tiny-llama-v0")
    engine = _engine(HFDecoder(llama, 128), store)
    (answer,) = generate_all(engine, [first], [SamplingParams(max_new_tokens=20, temperature=0.0)])
    second = first + answer.tokens + torch.randint(0, VOCAB_SIZE, (6,), generator=generator).tolist()
    hits_before = sum(store.stats.hits.values())
    params = [SamplingParams(max_new_tokens=10, temperature=0.0)]
    assert generate_all(engine, [second], params) == generate_all(_engine(HFDecoder(llama, 128)), [second], params)
    reused = sum(store.stats.hits.values()) - hits_before
    assert reused == (len(first) + len(answer.tokens) - 1) // 8  # the answer's blocks too, not only the prompt's


def test_new_weights_find_nothing_of_the_old_ones_in_any_tier(tmp_path):
    config = KVCacheConfig(block_tokens=BLOCK, device_bytes=BLOCK_BYTES, host_bytes=BLOCK_BYTES, disk_bytes=1 << 20,
                           disk_dir=str(tmp_path / "kv"))
    old = PrefixBlockStore(config, torch.device("cpu"), namespace="model@v1")
    tokens = list(range(3 * BLOCK))
    old.put(old.ids(tokens), [_block(1.0), _block(2.0), _block(3.0)])
    assert old.num_blocks() == {"device": 1, "host": 1, "disk": 1}
    new = PrefixBlockStore(config, torch.device("cpu"), namespace="model@v2")  # what a replica builds on a reload
    assert new.take(new.ids(tokens)) == [] and not list((tmp_path / "kv").glob("*.safetensors"))


def test_serve_options_take_a_kv_cache_for_built_in_replicas_and_a_routing():
    from baige_ray.serving.app import ServeOptions
    from baige_ray.serving.disaggregation import DisaggregationOptions

    assert ServeOptions(kv_cache=KVCacheConfig(block_tokens=32)).kv_cache.block_tokens == 32
    assert ServeOptions(kv_cache=KVCacheConfig(), disaggregation=DisaggregationOptions()).kv_cache.enabled
    with pytest.raises(ValueError, match="ServeOptions.kv_cache is set with engine='vllm'"):
        ServeOptions(kv_cache=KVCacheConfig(), engine="vllm")
    with pytest.raises(ValueError, match="ServeOptions.routing='nearest' is invalid"):
        ServeOptions(routing="nearest")
    with pytest.raises(ValueError, match="ServeOptions.routing='prefix' is set with disaggregation"):
        ServeOptions(routing="prefix", disaggregation=DisaggregationOptions())
    with pytest.raises(ValueError, match="ServeOptions.kv_cache=.*expected a KVCacheConfig"):
        ServeOptions(kv_cache={"block_tokens": 16})


def test_a_stopping_replica_hands_its_hottest_memory_blocks_to_a_peer_on_the_same_weights(tmp_path):
    giver = _store(tmp_path / "giver", device_blocks=2, host_blocks=2, disk_blocks=2)
    ids = [f"{i:064x}" for i in range(6)]
    for index, block_id in enumerate(ids):
        giver.put([block_id], [_block(float(index))])
    handover = giver.hottest(3 * BLOCK_BYTES)  # device (5, 4) then host (3); the disk tier's files stay
    assert handover.ids == [ids[3], ids[4], ids[5]] and giver.stats.handed_over == 3
    peer = _store(tmp_path / "peer", device_blocks=2, host_blocks=2, disk_blocks=0)
    assert peer.adopt(handover) == 3 and peer.stats.adopted == 3
    assert [peer.tier_of(i) for i in ids[3:]] == ["host", "device", "device"]  # the hottest stay the most recent
    (block,) = peer.take([ids[5]])
    assert torch.equal(block[0][0], torch.full((1, HEADS, BLOCK, HEAD_DIM), 5.0))
    other_weights = PrefixBlockStore(peer.config, torch.device("cpu"), namespace="model-v2")
    assert other_weights.adopt(handover) == 0 and other_weights.num_blocks()["device"] == 0
