"""A tiny Llama directory whose greedy answer to any chat is one Hermes tool call, for the
``auto`` tool-call tests of ``neuron-tp serve``: a byte-level tokenizer with Qwen2.5's chat
template (the tools in a system turn, an assistant's calls as ``<tool_call>{json}</tool_call>``,
tool results as ``<tool_response>`` in a user turn) and the call's pieces as added tokens; the
model a bigram table (every layer's output projections zero, so the last hidden state is the
token's embedding, and the output head maps each token of the chain to the next): the
generation prompt's final ``\\n`` -> ``<tool_call>`` -> ... -> ``</tool_call>`` -> ``<|im_end|>``
(EOS). :func:`hermes_dir` checks the chain with transformers' ``generate``."""

from __future__ import annotations

import os

import torch

CITY, DAYS = "Oslo", 2
# the answer, token by token (each an added token: the chain visits every one once)
PIECES = [
    "<tool_call>",
    '\n{"name": "',
    "weather",
    '", "arguments": {"city": "',
    CITY,
    '", "days": ',
    f"{DAYS}}}}}\n",
    "</tool_call>",
]
ANSWER = "".join(PIECES)
CALL = {"name": "weather", "arguments": {"city": CITY, "days": DAYS}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The forecast of a city for some days.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}

# Qwen2.5-Instruct's chat template: Hermes-style calls, an assistant's arguments rendered
# with ``| tojson`` (an object as JSON; a string would come out quoted)
TEMPLATE_FILE = os.path.join(os.path.dirname(__file__), "qwen25_chat_template.jinja")


def tokenizer(out: str):
    """The byte-level tokenizer (every byte a token, no merges; ``<|im_end|>`` EOS; the
    answer's pieces added) with Qwen2.5's template, saved to ``out`` and loaded back."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    bpe.add_tokens([AddedToken(p, normalized=False) for p in PIECES])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    with open(TEMPLATE_FILE) as f:
        tok.chat_template = f.read()
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def hermes_dir(out: str, seed: int = 0) -> str:
    """Write the tokenizer and the bigram Llama to ``out``; its greedy answer to a chat with
    the tools checked to be :data:`ANSWER` and EOS (transformers' ``generate``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer(out)
    vocab = len(tok)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    chain = [tok.convert_tokens_to_ids("Ċ")] + tok.convert_tokens_to_ids(PIECES)
    chain.append(tok.eos_token_id)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.randn(vocab, config.hidden_size)
        model.model.embed_tokens.weight.copy_(emb)
        normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
        head = torch.zeros(vocab, config.hidden_size)
        for now, after in zip(chain, chain[1:]):
            head[after] += normed[now] / normed[now].norm() * 8.0
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "weather in Oslo?"}], tools=[WEATHER_TOOL],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    out_ids = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    got = out_ids[0, len(ids) :].tolist()
    assert got == chain[1:], (tok.decode(got), got, chain)
    assert tok.decode(got, skip_special_tokens=True) == ANSWER, tok.decode(got)
    return out
