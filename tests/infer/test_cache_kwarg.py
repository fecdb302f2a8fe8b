"""The generators hand the model its cache under the name its forward takes: ``cache`` where
transformers >= 5.24 renamed it (``past_key_values=`` then warns, removal announced for 5.40),
``past_key_values`` before; the installed transformers' model gets it without a warning."""

from __future__ import annotations

import functools
import warnings

import torch
import transformers as tf

from neuron_tp.infer.model_step import cache_kwargs


def _renamed(func):
    """transformers 5.24's ``deprecate_kwarg("past_key_values", new_name="cache")``, in small."""

    @functools.wraps(func)
    def wrapped(self, *args, **kwargs):
        if "past_key_values" in kwargs:
            warnings.warn(
                "`past_key_values` is deprecated; use `cache`", FutureWarning, stacklevel=2
            )
            kwargs["cache"] = kwargs.pop("past_key_values")
        return func(self, *args, **kwargs)

    return wrapped


class _New(torch.nn.Module):
    @_renamed
    def forward(self, input_ids=None, cache=None, **kwargs):
        return cache


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return past_key_values


class _Wrapper(torch.nn.Module):  # a peft model: forward(*args, **kwargs), the base inside
    def __init__(self, base):
        super().__init__()
        self.base = base

    def get_base_model(self):
        return self.base

    def forward(self, *args, **kwargs):
        return self.base(*args, **kwargs)


def test_cache_goes_under_the_forwards_name():
    marker = object()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for model in (_New(), _Old(), _Wrapper(_New()), _Wrapper(_Old())):
            assert model(**cache_kwargs(model, marker)) is marker, type(model)
    assert list(cache_kwargs(_New(), 0)) == ["cache"]
    assert list(cache_kwargs(_Wrapper(_Old()), 0)) == ["past_key_values"]
    with warnings.catch_warnings(record=True) as seen:  # what the old name would do there
        warnings.simplefilter("always")
        _New()(past_key_values=marker)
    assert any(issubclass(w.category, FutureWarning) for w in seen)


def test_installed_transformers_takes_it_without_warning():
    cfg = tf.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
    )
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 32, (1, 4))
    cache = tf.DynamicCache(config=cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 4 and out.logits.shape == (1, 4, 32)
