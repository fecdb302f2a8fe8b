"""Token ids and loss mask of one instruction record (:mod:`.samples`).

``messages``: the tokenizer's chat template renders the chat; the loss tokens are the
assistant turns. When the template marks them (``{% generation %}``) the mask is the one
``apply_chat_template(..., return_assistant_tokens_mask=True)`` returns; otherwise it is found
by rendering prefix by prefix: the text an assistant message adds to the chat before it (with
the generation prompt, so the ``assistant`` header stays a prompt token) is that turn's answer.
``prompt-completion``: the completion (and the end-of-text token) is the loss; the
conversational form renders ``prompt + completion`` with the template, the completion is what
follows the rendered prompt. ``loss_on="all"``: every token is a loss token.
"""

from __future__ import annotations

import re

from ..errors import UserError
from .samples import MESSAGES, PROMPT_COMPLETION, TEXT, Record

GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")
ANSWERS, ALL = "answers", "all"


def encode(tokenizer, text: str, special: bool) -> list[int]:
    """``text``'s ids (``special``: with the tokenizer's BOS/EOS rules, as ``encode``)."""
    if special or not hasattr(tokenizer, "chat_template"):  # ByteTokenizer: no specials
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, add_special_tokens=False))


def template_of(tokenizer) -> str:
    """The tokenizer's chat template (UserError when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise UserError(
            f"chat data ('messages' or conversational 'prompt'/'completion') needs a tokenizer "
            f"with a chat template; {type(tokenizer).__name__} has none: pass --tokenizer DIR "
            "of a tokenizer whose tokenizer_config.json (or chat_template.jinja) holds one"
        )
    return template


def _render(tokenizer, messages: list[dict], where: str, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # noqa: BLE001 - the template's own error, with the line
        raise UserError(f"{where}: the chat template cannot render this chat: {e}") from None


def _answer_start(tokenizer, before: list[dict], upto: str, where: str) -> str:
    """The rendered text of ``before`` that the text ``upto`` (``before`` + one more message)
    starts with: with the generation prompt when it is a prefix, else without."""
    for gen in (True, False):
        prefix = _render(tokenizer, before, where, gen) if before else ""
        if upto.startswith(prefix):
            return prefix
    raise UserError(
        f"{where}: the chat template does not render a chat as the rendering of its first "
        "messages followed by more text, so the answer tokens cannot be found; mark the "
        "assistant turns in the template with {% generation %} ... {% endgeneration %}"
    )


def _pieces(tokenizer, messages: list[dict], answers: set[int], where: str):
    """``(text, is_answer)`` pieces whose concatenation is the rendered chat."""
    pieces, done = [], ""
    for i in range(len(messages)):
        upto = _render(tokenizer, messages[: i + 1], where, False)
        start = _answer_start(tokenizer, messages[:i], upto, where) if i in answers else done
        if not start.startswith(done) or not upto.startswith(start):
            raise UserError(
                f"{where}: the chat template renders message {i} by changing the text of "
                "the messages before it, so the answer tokens cannot be found; mark the "
                "assistant turns in the template with {% generation %} ... {% endgeneration %}"
            )
        pieces += [(start[len(done) :], False), (upto[len(start) :], i in answers)]
        done = upto
    full = _render(tokenizer, messages, where, False)
    pieces.append((full[len(done) :], False))  # anything the template adds at the end
    return [(t, a) for t, a in pieces if t]


def encode_chat(
    tokenizer, messages: list[dict], answers: set[int], where: str
) -> tuple[list[int], list[bool]]:
    """The ids of the rendered chat and, per id, whether it belongs to a message of
    ``answers`` (indices into ``messages``)."""
    template = template_of(tokenizer)
    assistant = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    if GENERATION_MARK.search(template) and answers == assistant:
        try:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as e:  # noqa: BLE001 - the template's own error, with the line
            raise UserError(f"{where}: the chat template cannot render this chat: {e}") from None
        ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        if any(mask) or not answers:
            return ids, mask
    ids, mask = [], []
    for text, is_answer in _pieces(tokenizer, messages, answers, where):
        piece = encode(tokenizer, text, special=False)
        ids += piece
        mask += [is_answer] * len(piece)
    return ids, mask


def encode_record(record: Record, tokenizer, loss_on: str) -> tuple[list[int], list[bool]]:
    """Ids of ``record`` and, per id, whether the loss is taken on it (``loss_on``:
    ``"answers"``, the assistant turns / the completion, or ``"all"``)."""
    v, where = record.value, record.where
    eos = getattr(tokenizer, "eos_token_id", None)
    if record.format == TEXT:
        ids = encode(tokenizer, v, special=True) + ([eos] if eos is not None else [])
        return ids, [True] * len(ids)
    if record.format == MESSAGES:
        msgs = v["messages"]
        answers = {i for i, m in enumerate(msgs) if m["role"] == "assistant"}
        if not answers and loss_on == ANSWERS:
            raise UserError(
                f"{where}: no 'assistant' message, so no answer to take the loss on; add "
                "one, leave the line out, or pass --loss-on all"
            )
        ids, mask = encode_chat(tokenizer, msgs, answers, where)
    elif record.format == PROMPT_COMPLETION and isinstance(v["prompt"], str):
        prompt = encode(tokenizer, v["prompt"], special=True)
        answer = encode(tokenizer, v["completion"], special=False)
        answer += [eos] if eos is not None else []
        ids, mask = prompt + answer, [False] * len(prompt) + [True] * len(answer)
    elif record.format == PROMPT_COMPLETION:
        msgs = v["prompt"] + v["completion"]
        answers = set(range(len(v["prompt"]), len(msgs)))
        ids, mask = encode_chat(tokenizer, msgs, answers, where)
    else:
        raise UserError(f"{where}: unknown format {record.format!r}")
    if loss_on == ALL:
        mask = [True] * len(ids)
    return ids, mask
