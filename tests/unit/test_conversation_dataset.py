"""ConversationDataset: conversations rendered by the model's own chat template into padded sequences whose
targets are the trained tokens only; reused, checked and refused as TokenDataset is."""

import json
import pickle

import pytest
import torch

from baige_ray.models.conversation_dataset import ConversationDataset
from baige_ray.models.plugin import IGNORE_INDEX

SEQ_LEN = 64


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Llama whose tokenizer holds Llama 3's published chat template, and 16 conversations."""
    from tests.hf_helpers import build_chat_data

    tiny, rows, _ = build_chat_data(tmp_path_factory.mktemp("chat"), count=16, seq_len=SEQ_LEN)
    return tiny, rows


def test_targets_are_the_replies_and_nothing_else(chat_model, tmp_path):
    from transformers import AutoTokenizer

    tiny, rows = chat_model
    dataset = ConversationDataset.build(rows, tokenizer=tiny.model_dir, seq_len=SEQ_LEN, directory=tmp_path / "d",
                                        packing="none")
    tokenizer = AutoTokenizer.from_pretrained(tiny.model_dir)
    conversations = [json.loads(line)["messages"] for line in rows.read_text().splitlines()]
    metadata = dataset.metadata
    assert metadata.num_conversations == 16 and metadata.num_sequences + metadata.num_dropped == 16
    inputs, targets = dataset.batch(range(dataset.num_sequences), seed=0)
    assert inputs.shape == targets.shape == (dataset.num_sequences, SEQ_LEN)
    assert dataset.trained_tokens(range(dataset.num_sequences), 0) == int((targets != IGNORE_INDEX).sum())
    assert metadata.num_trained_tokens == int((targets != IGNORE_INDEX).sum())
    replies = {}  # rendered conversation -> its replies, for those that fit
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= SEQ_LEN + 1:
            replies[text] = "".join(m["content"] + "<|eot_id|>" for m in conversation if m["role"] == "assistant")
    assert metadata.num_truncated == 16 - len(replies)
    checked = 0
    for row, sequence in zip(targets, dataset.sequence_ids(range(dataset.num_sequences), seed=0)):
        stored = torch.from_numpy(dataset.stored("tokens.bin")[sequence].astype("int64"))
        text = tokenizer.decode(stored[stored != metadata.pad_token_id])
        if text in replies:
            assert tokenizer.decode(row[row != IGNORE_INDEX]) == replies[text]
            checked += 1
    assert checked == len(replies) > 4
    assert 0 < dataset.padding_fraction < 1
    assert len(pickle.dumps(dataset)) < 4096


def test_a_rebuild_reuses_refuses_other_settings_and_repairs_corruption(chat_model, tmp_path):
    tiny, rows = chat_model
    build = dict(tokenizer=tiny.model_dir, seq_len=SEQ_LEN, directory=tmp_path / "d")
    first = ConversationDataset.build(rows, **build)
    written = (first.directory / "tokens.bin").stat().st_mtime_ns
    assert ConversationDataset.build(rows, **build) == first
    assert (first.directory / "tokens.bin").stat().st_mtime_ns == written
    with pytest.raises(ValueError, match="built differently.*train_on 'assistant' != 'all'"):
        ConversationDataset.build(rows, **build, train_on="all")

    trained = first.directory / "trained.bin"
    data = bytearray(trained.read_bytes())
    data[5] ^= 1
    trained.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="trained.bin fails its SHA-256 check"):
        ConversationDataset.open(first.directory)
    repaired = ConversationDataset.build(rows, **build)
    assert repaired.metadata.trained_sha256 == first.metadata.trained_sha256
    assert torch.equal(repaired.batch(range(4), 0)[1], first.batch(range(4), 0)[1])


def test_long_conversations_are_refused_or_truncated_as_asked(chat_model, tmp_path):
    tiny, rows = chat_model
    with pytest.raises(ValueError, match=r"row \d+: the conversation has \d+ tokens, more than seq_len \+ 1 = 17"):
        ConversationDataset.build(rows, tokenizer=tiny.model_dir, seq_len=16, directory=tmp_path / "a",
                                  too_long="refuse")
    cut = ConversationDataset.build(rows, tokenizer=tiny.model_dir, seq_len=48, directory=tmp_path / "b")
    assert cut.metadata.num_truncated > 0
    assert cut.metadata.num_sequences == 16 - cut.metadata.num_dropped


def test_files_without_rows_or_templates_are_refused(chat_model, tmp_path):
    tiny, rows = chat_model
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    with pytest.raises(ValueError, match="not a file of rows.*TokenDataset"):
        ConversationDataset.build(text, tokenizer=tiny.model_dir, seq_len=SEQ_LEN, directory=tmp_path / "a")
    with pytest.raises(ValueError, match="no chat template: pass chat_template="):
        ConversationDataset.build(rows, tokenizer=tiny.tokenizer_dir, seq_len=SEQ_LEN, directory=tmp_path / "b")
    with pytest.raises(ValueError, match="train_on='everything' is invalid"):
        ConversationDataset.build(rows, tokenizer=tiny.model_dir, seq_len=SEQ_LEN, directory=tmp_path / "c",
                                  train_on="everything")


def test_packing_holds_the_same_trained_tokens_in_fewer_sequences(chat_model, tmp_path):
    tiny, rows = chat_model
    build = dict(tokenizer=tiny.model_dir, seq_len=2 * SEQ_LEN)
    alone = ConversationDataset.build(rows, **build, directory=tmp_path / "alone", packing="none")
    packed = ConversationDataset.build(rows, **build, directory=tmp_path / "packed")
    assert packed.packs_documents and alone.positions(range(2), 0) is None
    assert packed.metadata.num_trained_tokens == alone.metadata.num_trained_tokens
    assert packed.num_sequences < alone.num_sequences and packed.padding_fraction < alone.padding_fraction
    everything = range(packed.num_sequences)
    inputs, targets = packed.batch(everything, 0)
    positions = packed.positions(everything, 0)
    assert positions.shape == inputs.shape and int((positions == 0).sum()) >= packed.metadata.num_conversations
    starts = torch.nonzero(positions[:, 1:] == 0)  # a document starting at t + 1 is not t's target
    assert bool((targets[starts[:, 0], starts[:, 1]] == IGNORE_INDEX).all())
