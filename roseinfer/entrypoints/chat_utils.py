"""Chat messages -> one prompt string, through the model's chat template (vLLM's entrypoints/chat_utils.py).

A chat model was trained on conversations written in its own markup, and its checkpoint ships that markup as a
Jinja template (tokenizer_config.json's "chat_template", or chat_template.jinja):

    [{"role": "user", "content": "Hi!"}]
        Llama 3    <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nHi!<|eot_id|>
                   <|start_header_id|>assistant<|end_header_id|>\\n\\n          <- add_generation_prompt
        Qwen2      <|im_start|>user\\nHi!<|im_end|>\\n<|im_start|>assistant\\n
        Mistral    <s>[INST] Hi! [/INST]

The template sees `messages`, `add_generation_prompt` (end with the header of the assistant's turn, so the model
answers), `tools` (the functions the model may call, as OpenAI's {"type": "function", "function": {...}} dicts,
or None) and the special tokens by name (`bos_token`, `eos_token` ...). An assistant message that calls tools
has `tool_calls` and may have no content; a tool's answer is a message with role "tool". The rendering is
transformers' own (`render_jinja_template`, the function behind `tokenizer.apply_chat_template`), so the text is
byte for byte what transformers makes; without transformers, a jinja2 sandbox set up the same way renders it.

The rendered text already holds the BOS if the model wants one, so it is tokenized with
`add_special_tokens=False` (as `apply_chat_template(tokenize=True)` does): no second BOS.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

Message = dict[str, str]
Conversation = list[Message]


def parse_chat_messages(messages) -> list[Conversation]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them -> a list of conversations.
    TypeError / ValueError naming the message at fault."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts (one conversation) or a list of "
                        f"such lists, got {type(messages).__name__}")  # fmt: skip
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    batched = isinstance(messages[0], (list, tuple))
    conversations = list(messages) if batched else [messages]
    for c, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(f"conversation {c} must be a list of messages, got {type(conversation).__name__}")
        check_conversation(conversation, f"conversation {c}, " if batched else "")
    return [list(c) for c in conversations]


def check_conversation(conversation: Conversation, where: str = "") -> None:
    """Every message a dict with string 'role' and 'content' (`where` prefixes the error: "conversation 2, "); an
    assistant message with 'tool_calls' may have no content (or None)."""
    if not isinstance(conversation, (list, tuple)):
        raise TypeError(f"a conversation must be a list of messages, got {type(conversation).__name__}")
    if not conversation:
        raise ValueError(f"{where}the conversation is empty: give at least one message")
    for m, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise TypeError(f"{where}message {m} must be a dict with 'role' and 'content', "
                            f"got {type(message).__name__}")  # fmt: skip
        for key in ("role", "content"):
            if key == "content" and message.get("tool_calls") and message.get("content") is None:
                continue
            if key not in message:
                raise ValueError(f"{where}message {m} has no {key!r}: a message is {{'role': ..., 'content': ...}}")
            if not isinstance(message[key], str):
                raise TypeError(f"{where}message {m}: {key} must be a string, got {type(message[key]).__name__}"
                                + (" (content parts are not supported)" if key == "content" else ""))  # fmt: skip


def resolve_chat_template(model_template: str | dict[str, str] | None, chat_template: str | None = None) -> str:
    """The template to use, chosen as transformers' `get_chat_template` chooses: the caller's `chat_template` (a
    template, or the name of one of the model's), else the model's (its "default" if it has several)."""
    if isinstance(model_template, dict):
        if chat_template is not None:
            return model_template.get(chat_template, chat_template)
        if "default" in model_template:
            return model_template["default"]
        raise ValueError(f"the model has several chat templates ({sorted(model_template)}) and none is 'default': "
                         f"pass chat_template=<one of those names, or a template>")  # fmt: skip
    if chat_template is not None:
        return chat_template
    if model_template is None:
        raise ValueError(
            "the model has no chat template (no 'chat_template' in tokenizer_config.json, no chat_template.jinja), "
            "and since transformers v4.44 there is no default one: pass chat_template=<a Jinja template string> "
            "(to LLM.chat), or add one to the model directory"
        )
    return model_template


def apply_chat_template(tokenizer, messages: Conversation, add_generation_prompt: bool = True,
                        chat_template: str | None = None, continue_final_message: bool = False,
                        tools: list[dict] | None = None, **kwargs) -> str:  # fmt: skip
    """One conversation as prompt text, rendered by the model's template (or `chat_template`): the same string as
    transformers' `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    `tokenizer`: anything with `chat_template` and `special_tokens_map` (Tokenizer, FastTokenizer). Extra
    keyword arguments reach the template (e.g. `enable_thinking=False` for Qwen3). `continue_final_message`:
    the text ends inside the last message, so that the model continues it (a prefilled answer). `tools`: the
    functions the template shows the model (OpenAI's tool dicts)."""
    from jinja2.exceptions import TemplateError

    check_conversation(messages)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: the first starts "
                         "a new message, the second continues the last one")  # fmt: skip
    template = resolve_chat_template(getattr(tokenizer, "chat_template", None), chat_template)
    template_kwargs = {**getattr(tokenizer, "special_tokens_map", {}), **kwargs}
    # transformers drops keys whose value is None (an OpenAI-style "tool_calls": None)
    conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return render_chat_template(template, conversation, add_generation_prompt, continue_final_message,
                                    tools=tools, **template_kwargs)  # fmt: skip
    except TemplateError as e:  # a syntax error, or the template's raise_exception("roles must alternate ...")
        raise ValueError(f"the chat template could not render these messages: {e}") from e


def chat_prompt_token_ids(tokenizer, messages: Conversation, add_generation_prompt: bool = True,
                          chat_template: str | None = None, continue_final_message: bool = False,
                          tools: list[dict] | None = None, **kwargs) -> tuple[str, list[int]]:  # fmt: skip
    """(the rendered prompt, its token ids): the ids of `apply_chat_template(..., tokenize=True)`, i.e. the text
    tokenized without adding special tokens, since the template wrote the BOS itself if the model wants one."""
    text = apply_chat_template(tokenizer, messages, add_generation_prompt, chat_template, continue_final_message,
                               tools, **kwargs)  # fmt: skip
    return text, tokenizer.encode(text, add_special_tokens=False)


def render_chat_template(template: str, messages: Conversation, add_generation_prompt: bool,
                         continue_final_message: bool = False, tools: list[dict] | None = None,
                         **kwargs) -> str:  # fmt: skip
    """Render with transformers' renderer if it is installed, else with `render_with_jinja2`."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return render_with_jinja2(template, messages, add_generation_prompt, continue_final_message, tools, **kwargs)
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, **kwargs)  # fmt: skip
    return rendered[0]


def render_with_jinja2(template: str, messages: Conversation, add_generation_prompt: bool,
                       continue_final_message: bool = False, tools: list[dict] | None = None,
                       **kwargs) -> str:  # fmt: skip
    """The environment transformers renders chat templates in, rebuilt: a sandbox (a template from the Hub is
    untrusted code), trim_blocks + lstrip_blocks (a `{% ... %}` line leaves no whitespace behind), loop controls,
    `tojson` that keeps non-ASCII text, `raise_exception` and `strftime_now` for templates to call. To continue
    the final message, the text is cut right after that message's content, where the template closed it."""
    text = _compile(template).render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **kwargs)  # fmt: skip
    if continue_final_message:
        content = (messages[-1].get("content") or "").strip()
        if content not in text:
            raise ValueError("continue_final_message is set but the chat template does not write the final "
                             "message's content as it is")  # fmt: skip
        text = text[: text.rindex(content) + len(content)]
    return text


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):  # {% generation %}...{% endgeneration %}: marks the assistant's text
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
