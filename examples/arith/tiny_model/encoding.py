"""Rendering and token encoding of chat transcripts the way the capture path sees them.

Contract:
- `render(tokenizer, messages, tools, add_generation_prompt)` is the tokenizer's chat template
  applied as text (no tokenization).
- `encode_transcript(tokenizer, messages, tools, family)` (batched: `encode_transcripts`) returns
  `EncodedTranscript(ids, loss_mask)` built segment by segment, as the generation worker builds
  a multi-turn prompt: the rendered prompt up to the generation prompt (ChatML
  `<|im_start|>assistant\\n`), then the assistant's body up to and including the family's eos
  (`<|im_end|>`, `<|eot_id|>`) encoded on its own (these are the tokens the model generates;
  loss_mask True), then the next rendered tail starting right after the eos (ChatML: the `\\n`
  that closes the turn; Llama-3: the next header), and so on.
- It checks the template invariants it relies on and raises `TemplateInvariantError` naming
  the message index when they do not hold: each prompt extends the text already encoded, and
  each assistant turn ends with the family's `turn_end` (ChatML `<|im_end|>\\n`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from examples.arith.tiny_model.chat_template import CHATML, TemplateFamily


class TemplateInvariantError(ValueError):
    """The chat template broke the prefix / turn-end invariant the encoder relies on."""


@dataclass(frozen=True)
class EncodedTranscript:
    ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.loss_mask):
            raise ValueError(f"ids ({len(self.ids)}) and loss_mask ({len(self.loss_mask)}) differ in length")
        if not any(self.loss_mask):
            raise ValueError("transcript has no assistant tokens to train on")


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list[dict] | None,
    add_generation_prompt: bool,
) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def transcript_segments(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None, family: TemplateFamily = CHATML
) -> list[tuple[str, bool]]:
    """The transcript as (text, is_assistant_body) segments in capture-path order."""
    segments: list[tuple[str, bool]] = []
    consumed = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:k], tools, add_generation_prompt=True)
        turn = render(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
        if not prompt.startswith(consumed) or not turn.startswith(prompt):
            raise TemplateInvariantError(
                f"message {k}: rendering messages[:{k}] is not a prefix of messages[:{k + 1}]; "
                "the chat template re-renders history"
            )
        if not turn.endswith(family.turn_end):
            raise TemplateInvariantError(f"message {k}: assistant turn does not end with {family.turn_end!r}")
        # The model samples through its eos; whatever the turn end renders after it is tail text.
        sampled_end = len(turn) - len(family.turn_end) + len(family.eos_token)
        segments.append((prompt[len(consumed) :], False))
        segments.append((turn[len(prompt) : sampled_end], True))
        consumed = turn[:sampled_end]
    return segments


def encode_transcripts(
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    tools: list[dict] | None,
    family: TemplateFamily = CHATML,
) -> list[EncodedTranscript]:
    """`encode_transcript` for many conversations with one batched tokenizer call."""
    per_conversation = [transcript_segments(tokenizer, messages, tools, family) for messages in conversations]
    texts = [text for segments in per_conversation for text, _ in segments]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    out: list[EncodedTranscript] = []
    for segments in per_conversation:
        ids: list[int] = []
        mask: list[bool] = []
        for _, trained in segments:
            piece = list(next(encoded))
            ids += piece
            mask += [trained] * len(piece)
        out.append(EncodedTranscript(ids=tuple(ids), loss_mask=tuple(mask)))
    return out


def encode_transcript(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None, family: TemplateFamily = CHATML
) -> EncodedTranscript:
    return encode_transcripts(tokenizer, [messages], tools, family)[0]
