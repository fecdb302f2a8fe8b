"""Bad generation requests get a ValueError that names the problem and what is valid, before
any device work; so does a model whose sliding window is shorter than the cache."""

from __future__ import annotations

import pytest
import torch

from neuron_tp.infer.sampling import Sampling
from neuron_tp.infer.static_generator import Generator
from neuron_tp.job.presets import build_model


@pytest.fixture(scope="module")
def gen():
    return Generator(build_model("tiny-llama", 257, 0).eval(), [8, 16], 20, batch_buckets=[1, 4])


@pytest.mark.parametrize(
    "prompts, new, eos, match",
    [
        ([list(range(17))], 4, (), r"prompt of 17 tokens is longer than the largest bucket 16"),
        ([[1]] * 5, 4, (), r"batch of 5 sequences .* largest bucket 4 \(buckets: 1, 4\)"),
        ([[1]], 21, (), r"max_new_tokens must be in 1..20, got 21"),
        ([[1]], 0, (), r"max_new_tokens must be in 1..20, got 0"),
        ([[1], []], 4, (), r"every prompt needs at least one token"),
        ([[1]], 4, tuple(range(9)), r"at most 8 EOS ids, got 9"),
    ],
)
def test_bad_requests_are_refused_by_name(gen, prompts, new, eos, match):
    with pytest.raises(ValueError, match=match):
        gen.check(prompts, new, eos)
    with pytest.raises(ValueError, match=match):
        next(gen.stream(prompts, new, eos_ids=eos))


@pytest.mark.parametrize(
    "kw, match",
    [({"temperature": 0.0}, "temperature must be > 0"), ({"top_k": -1}, "top_k must be >= 0")],
)
def test_bad_sampling_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(do_sample=True, **kw)


def test_sliding_window_shorter_than_the_cache_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(window: int):
        torch.manual_seed(0)
        cfg = MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
            sliding_window=window,
        )
        return MistralForCausalLM(cfg).eval()

    with pytest.raises(
        ValueError, match=r"sliding window \(100 positions\) is shorter than the 144"
    ):
        Generator(mistral(100), [16], 8)
    model = mistral(144)  # a window that holds the whole cache never rolls: accepted
    got = Generator(model, [16], 8).generate([[3, 4, 5]], 8)
    ref = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=8, do_sample=False)
    assert got == [ref[0, 3:].tolist()]
