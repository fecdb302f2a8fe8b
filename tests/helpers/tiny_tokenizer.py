"""Small HF tokenizers and model directories built offline for tests: a byte-level BPE
trained on the demo corpus (``tokenizers``) saved as a transformers tokenizer directory, and a
tiny Llama directory that holds it (as every real HF model directory holds its tokenizer)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "data", "corpus.txt")
# A chat template whose assistant turns are marked ({% generation %}: transformers returns
# their mask); PLAIN_CHAT_TEMPLATE is the same text without the marks (the loss tokens are
# then found by rendering prefix by prefix). An answer's loss tokens: its content and EOS.
CHAT_TEMPLATE = (
    r"{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|assistant|>\n' }}"
    r"{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}"
    r"{% else %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}{% endif %}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
PLAIN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)


def bpe_tokenizer_dir(out: str, vocab: int = 300, chat_template: bool | str = False) -> str:
    """Write a BPE tokenizer of ``vocab`` tokens (``<unk>`` 0, ``</s>`` 1 = EOS) to ``out``;
    ``chat_template``: True for a one-line-per-message template, or the template itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token
    )
    bpe.train([CORPUS], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>")
    if isinstance(chat_template, str):
        tok.chat_template = chat_template
    elif chat_template:
        tok.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        )
    tok.save_pretrained(out)
    return out


def llama_dir(out: str, vocab: int, seed: int = 0, tokenizer_vocab: int | None = None) -> str:
    """A tiny Llama (the tiny-llama preset's shape, ``vocab`` embedding rows, random init from
    ``seed``) saved to ``out`` with transformers, with a BPE tokenizer of ``tokenizer_vocab``
    tokens in it (None: no tokenizer files)."""
    from neuron_tp.job.presets import build_model

    build_model("tiny-llama", vocab, seed).save_pretrained(out)
    if tokenizer_vocab is not None:
        bpe_tokenizer_dir(out, tokenizer_vocab)
    return out
