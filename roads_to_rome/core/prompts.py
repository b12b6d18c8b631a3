"""A prompt as the models read it, from what a client brings: a user message or a conversation in the tokenizer's chat
template (core/chat_template.py renders it), text as it is, or fill in the middle in a code model's own format.
`Engine.prompts` is one for the engine's tokenizer."""

from __future__ import annotations

import functools

from roads_to_rome.core.chat_template import encode_messages
from roads_to_rome.errors import R2RError

# Fill-in-the-middle markers, as code models spell them: (prefix, suffix, middle).
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))  # StarCoder, SantaCoder


class Prompts:
    """Token ids for prompts, with one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def chat(self, message: str) -> list[int]:
        """A user message in the model's chat template, ready for the assistant's answer."""
        return self.messages([{"role": "user", "content": message}])

    def messages(self, messages: list[dict], template_kwargs: dict | None = None, tools: list[dict] | None = None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 template: str | None = None) -> list[int]:
        """Messages in the model's chat template (`chat_template.encode_messages`)."""
        return encode_messages(self.tokenizer, messages, template_kwargs, tools, add_generation_prompt,
                               continue_final_message, template)

    def prompt(self, prompt: str, suffix: str | None = None) -> list[int]:
        """A benchmark item's or a label prompt's tokens: a user message in the chat template, or with `suffix` the
        text between `prompt` and `suffix`, asked as fill in the middle."""
        return self.chat(prompt) if suffix is None else self.infill(prompt, suffix)

    def raw(self, text: str) -> list[int]:
        """Text as it is (with the tokenizer's own special tokens, a BOS where it adds one)."""
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def infill(self, prefix: str, suffix: str) -> list[int]:
        """Fill in the middle: the text between `prefix` and `suffix`, asked in the code model's own format (prefix,
        suffix, then the middle's marker: Qwen2.5-Coder's and StarCoder's tokens)."""
        if self.fim_ids is None:
            raise R2RError("this model has no fill-in-the-middle tokens (Qwen2.5-Coder's <|fim_prefix|>, "
                           "<|fim_suffix|>, <|fim_middle|> or StarCoder's): leave the suffix out")
        begin, hole, middle = self.fim_ids
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        return [begin, *encode(prefix), hole, *encode(suffix), middle]

    @functools.cached_property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The tokenizer's fill-in-the-middle tokens (prefix, suffix, middle), or None."""
        for names in FIM_TOKENS:
            ids = [self.tokenizer.convert_tokens_to_ids(name) for name in names]
            if all(isinstance(i, int) and i != self.tokenizer.unk_token_id for i in ids):
                return tuple(ids)
        return None
