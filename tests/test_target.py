import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY_TARGET
from dflash.errors import DflashError
from dflash.target import Target, default_layer_ids, resolve_target


def test_default_layer_ids_match_the_reference():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as the reference chooses
    assert default_layer_ids(28, 1) == [14]
    assert default_layer_ids(6, 3) == [1, 2, 3]
    with pytest.raises(DflashError, match="too few layers"):
        default_layer_ids(6, 5)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()


def test_hooks_capture_hf_hidden_states_including_the_last_layer(model):
    target = Target(model, [0, 2, 5])
    ids = torch.randint(4, 4000, (2, 37), generator=torch.Generator().manual_seed(0))
    hidden, last = target.forward(ids)
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
    for h, i in zip(hidden, [0, 2, 5]):  # layer id i = output_hidden_states[i + 1]
        torch.testing.assert_close(h, ref.hidden_states[i + 1], rtol=0, atol=0)
    greedy = target.greedy(last.reshape(-1, last.shape[-1]))
    assert torch.equal(greedy, ref.logits.argmax(-1).reshape(-1))


def test_greedy_is_chunked_without_changing_the_result(model):
    h = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(Target(model, [1], greedy_chunk=7).greedy(h), model.lm_head(h).argmax(-1))


def test_layer_beyond_depth_and_missing_target_are_named(model):
    with pytest.raises(DflashError, match=r"layer id 6 is beyond the target's depth \(6 decoder layers"):
        Target(model, [1, 6])
    with pytest.raises(DflashError, match="--target /no/such/model: not a model folder"):
        resolve_target("/no/such/model")
