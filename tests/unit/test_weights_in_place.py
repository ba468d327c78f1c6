"""New weights copied into a built model by name (models/weights_in_place.py), as the built-in engine
takes each refit of an RL policy."""

import pytest
import torch
import transformers

from baige_ray.models.weights_in_place import copy_weights_in_place


def tied_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def test_a_tied_models_weights_arrive_without_its_head_and_generate_as_the_source():
    served, trained = tied_llama(0), tied_llama(1)
    weights = {name: value for name, value in trained.state_dict().items() if name != "lm_head.weight"}
    copy_weights_in_place(served, weights)
    tokens = torch.tensor([[1, 5, 9]])
    assert torch.equal(served(tokens).logits, trained(tokens).logits)
    assert served.lm_head.weight.data_ptr() == served.model.embed_tokens.weight.data_ptr()  # still tied


@pytest.mark.parametrize("change, words", [
    (lambda w: w.update({"model.extra.weight": torch.zeros(1)}), "unknown names ['model.extra.weight']"),
    (lambda w: w.update({"model.norm.weight": torch.zeros(3)}), "other shapes ['model.norm.weight']"),
    (lambda w: w.pop("model.norm.weight"), "missing ['model.norm.weight']"),
])
def test_weights_that_do_not_fit_are_refused_before_anything_is_copied(change, words):
    served, trained = tied_llama(0), tied_llama(1)
    before = {name: value.clone() for name, value in served.state_dict().items()}
    weights = dict(trained.state_dict())
    change(weights)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        copy_weights_in_place(served, weights)
    assert all(torch.equal(value, before[name]) for name, value in served.state_dict().items())
