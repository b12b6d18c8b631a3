"""Messages written in a model's chat template (transformers' `apply_chat_template`, which runs it in Jinja's sandbox),
with what a client can get wrong said as an `R2RError`. Light on purpose (no torch): a server renders the templates
requests bring in a process of its own (serving/guard.py, `TemplateLane`), which imports only this."""

from __future__ import annotations

import os
import resource

from roads_to_rome.errors import R2RError

# Names a chat template is rendered with beside apply_chat_template's own parameters (transformers'
# `render_jinja_template`): chat_template_kwargs may not set them either.
TEMPLATE_NAMES = frozenset({"self", "messages", "tools", "documents", "add_generation_prompt", "conversations"})


def encode_messages(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template: str | None = None) -> list[int]:
    """Messages in the model's chat template, ready for the assistant's answer; `template_kwargs`: variables
    the template reads (Qwen3's `enable_thinking`, say); `tools`: the functions the model may call (OpenAI's
    shape), which the template shows it. `add_generation_prompt` false ends the prompt after the last message;
    `continue_final_message` leaves the last message open, for the answer to go on writing it. `template`: a
    Jinja chat template to write them in instead of the tokenizer's."""
    import inspect

    import jinja2

    if template is None and not getattr(tokenizer, "chat_template", None):
        raise R2RError("the model's tokenizer has no chat template: give the prompt as plain text (--raw, "
                       "or /v1/completions on the server), or give one (--chat-template)")
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | TEMPLATE_NAMES
    if clash := sorted(own.intersection(template_kwargs or {})):
        raise R2RError(f"chat_template_kwargs may not set {', '.join(clash)}: the chat template's call sets it")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template, tokenize=True,
            return_dict=False,
            **(template_kwargs or {}))
    except jinja2.TemplateSyntaxError as e:  # a template given with the request
        raise R2RError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
    except jinja2.TemplateError as e:  # the template's own refusal (raise_exception), or a variable it cannot use
        raise R2RError(f"the chat template refused these messages: {e}") from None
    except ValueError as e:  # transformers': the template did not write the last message where it can go on
        if continue_final_message:
            raise R2RError(f"the chat template cannot leave the last message open ({e}): ask without "
                           "continue_final_message") from None
        if template is None and not template_kwargs:
            raise
        raise R2RError(f"the chat template failed on these messages: {e}") from None
    except (TypeError, OverflowError, RecursionError) as e:  # a template or its variables, as a client gave them
        if template is None and not template_kwargs:
            raise
        raise R2RError(f"the chat template failed on these messages ({type(e).__name__}: {e}): mend the "
                       "template or chat_template_kwargs") from None


def serve_templates(connection, tokenizer, memory_bytes: int) -> None:
    """A process's loop that writes chats in templates requests bring (`TemplateLane`): first ("ready", None) once it
    has started, then for each job (`encode_messages`' arguments) an answer, ("ok", ids) or ("error", message). Its
    address space may grow by `memory_bytes` past what it holds once started: a template that builds more fails with
    a MemoryError, here."""
    import jinja2  # noqa: F401 - (loaded before the limit is set)

    tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ messages[0].content }}",
                                  tokenize=True)  # (what a first render loads, before the limit is set too)
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + memory_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    connection.send(("ready", None))  # (a template's time counts from here: starting takes seconds on a busy machine)
    while True:
        try:
            job = connection.recv()
        except EOFError:  # the server went away
            return
        try:
            answer = ("ok", encode_messages(tokenizer, *job))
        except R2RError as e:
            answer = ("error", str(e))
        except MemoryError:
            answer = ("error", f"the chat template took more than {memory_bytes >> 20} MiB to write these messages")
        except Exception as e:  # noqa: BLE001 - whatever a client's template raises is the client's to mend
            answer = ("error", f"the chat template failed on these messages ({type(e).__name__}: {e})")
        connection.send(answer)


def address_space() -> int:
    """This process's virtual memory now, in bytes (what RLIMIT_AS counts)."""
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
