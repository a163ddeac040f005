"""The tiny Llama's tokenizer files in Llama 3's layout, its chat samples, and a check that transformers loads it.

    python tools/models/llama_tokenizer.py [MODEL_DIR]      # default: roseinfer/models/tiny-llama-shakespeare

tools/models/train_tiny_model.py --arch llama uses this module. The vocabulary is the bundled GPT-2's
(the same byte-level BPE, retrained the same way); what changes is the pipeline around it:

- special tokens after the ordinary ones: <|begin_of_text|> (BOS), <|end_of_text|> (EOS), the
  chat markers <|start_header_id|> <|end_header_id|> <|eot_id|>, then reserved tokens that pad the
  vocabulary to a multiple of 8 (Llama 3 reserves 250 of them; they are never trained);
- tokenizer.json: ByteLevel pre-tokenizer with GPT-2's regex, and a TemplateProcessing
  post-processor that prepends <|begin_of_text|> to every encoded text, as Llama 3's does;
- tokenizer_config.json: names BOS and EOS and carries a Llama 3 chat template: each message is
  `<|start_header_id|>role<|end_header_id|>\\n\\n` + content + `<|eot_id|>`, and
  add_generation_prompt opens an assistant header for the model to fill. With `tools`, a system
  block lists them as JSON and asks for Hermes-style `<tool_call>{"name": ..., "arguments": ...}
  </tool_call>` answers; an assistant's tool_calls are written back that way, and a tool's result
  is a `tool` turn in `<tool_response>` tags (the model was never trained on any of it).

chat_samples() turns short exchanges of a play into user/assistant messages for that template,
and chat_sample_ids() into the token ids the model trains on.

Run as a script, it loads a trained directory with transformers' Auto classes and prints a greedy
continuation of a Shakespeare prompt and a chat reply.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
START_HEADER, END_HEADER, EOT_ID = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIALS = (BOS, EOS, START_HEADER, END_HEADER, EOT_ID)
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    r"{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    r"{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] | trim + '\n\n' }}{%- endif %}"
    r"{{- 'You may call one or more functions. They are listed in <tools></tools> tags:\n<tools>' }}"
    r"{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    r"""{{- '\n</tools>\n\nTo call a function, answer with a JSON object with its name and arguments in """
    r"""<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}"""
    r"""\n</tool_call><|eot_id|>' }}"""
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    r"{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    r"{%- if message['content'] %}{{- message['content'] | trim + '\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    r"{%- if not loop.first %}{{- '\n' }}{%- endif %}"
    r"""{{- '<tool_call>\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' + (fn['arguments'] | tojson) """
    r"""+ '}\n</tool_call>' }}"""
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    r"{{- '<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\n' + message['content'] | trim"
    r" + '\n</tool_response><|eot_id|>' }}"
    "{%- else %}"
    r"{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)  # fmt: skip


SPEAKER = re.compile(r"[A-Z][A-Za-z' ]{0,28}\.")  # the line that opens a speech: "HAMLET." "Oph." "First Lord."


def chat_samples(play: str, every: int = 10, max_chars: int = 400) -> list[list[dict]]:
    """Every `every`-th speech that another speaker answers at once, as user/assistant messages."""
    speeches = []  # (block index, speaker, lines without stage directions)
    for i, block in enumerate(play.split("\n\n")):
        head, *lines = block.strip("\n").split("\n")
        lines = [line.strip() for line in lines if not line.lstrip().startswith("[")]
        if SPEAKER.fullmatch(head) and lines:
            speeches.append((i, head, "\n".join(lines)))
    samples = []
    for k, ((i, a, x), (j, b, y)) in enumerate(zip(speeches, speeches[1:], strict=False)):
        if k % every == 0 and j == i + 1 and a != b and max(len(x), len(y)) <= max_chars:
            samples.append([{"role": "user", "content": x}, {"role": "assistant", "content": y}])
    return samples


def chat_sample_ids(tok, render, messages: list[dict]) -> list[int]:
    r"""A chat sample as a request produces it: the prompt (add_generation_prompt), then the reply.

    Encoding the whole rendered chat at once would give other ids: GPT-2's regex splits the
    header's "\n\n" into "\n" + "\n" before a word, but a prompt that ends with the assistant
    header ends in the single token "\n\n". So the reply and its <|eot_id|> are encoded apart,
    as generation appends them."""
    *prompt, reply = messages
    text = render(prompt, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False).ids
    return ids + tok.encode(reply["content"].strip() + EOT_ID, add_special_tokens=False).ids


def special_tokens(n_ordinary: int, multiple: int = 8) -> list[str]:
    """SPECIALS, then reserved tokens until the vocabulary size is a multiple of `multiple`."""
    n_reserved = -(n_ordinary + len(SPECIALS)) % multiple
    return list(SPECIALS) + [f"<|reserved_special_token_{i}|>" for i in range(n_reserved)]


def add_bos_template(tok) -> None:
    """Every encoded text starts with <|begin_of_text|> (skipped with add_special_tokens=False)."""
    from tokenizers import processors

    bos = tok.token_to_id(BOS)
    template = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
    )
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


def transformers_tokenizer(tok, model_max_length: int):
    """The in-memory transformers tokenizer that tokenizer_config.json describes."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )  # fmt: skip


def write(tok, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (written by hand, so the chat template stays in it)."""
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(a["id"]): {"content": a["content"], "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": True}
        for a in json.loads(tok.to_str())["added_tokens"]
    }  # fmt: skip
    config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def check(out_dir: Path, prompt: str = "ROMEO.\nBut soft, what light", user: str = "What say you, my lord?") -> dict:
    """Load `out_dir` with transformers' Auto classes; greedy-decode a prompt and a chat reply."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM", type(model).__name__
    ids = tok(prompt).input_ids
    assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[0]) == BOS, "no BOS prepended"
    assert tok.decode(ids, skip_special_tokens=True) == prompt, "decode(encode(text)) != text"
    assert len(tok) == model.config.vocab_size, (len(tok), model.config.vocab_size)
    eos = model.generation_config.eos_token_id
    assert eos == [tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(EOT_ID)], eos

    messages = [{"role": "user", "content": user}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = f"{BOS}{START_HEADER}user{END_HEADER}\n\n{user}{EOT_ID}{START_HEADER}assistant{END_HEADER}\n\n"
    assert text == want, repr(text)
    chat_ids = tok(text, add_special_tokens=False).input_ids
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat_ids == list(templated), (chat_ids, templated)

    with torch.no_grad():
        plain = model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False)
        chat = model.generate(torch.tensor([chat_ids]), max_new_tokens=60, do_sample=False)
    reply = chat[0, len(chat_ids) :].tolist()
    result = {
        "prompt": prompt,
        "continuation": tok.decode(plain[0, len(ids) :], skip_special_tokens=True),
        "chat_prompt": text,
        "chat_reply": tok.decode(reply, skip_special_tokens=True),
        "chat_reply_ends_with_eot": tok.convert_ids_to_tokens(reply[-1]) in (EOT_ID, EOS),
    }
    print(f"--- greedy continuation of {prompt!r}:\n{prompt}{result['continuation']}")
    stop = "<|eot_id|>" if result["chat_reply_ends_with_eot"] else "60 tokens"
    print(f"--- greedy chat reply to {user!r} (stopped at {stop}):")
    print(result["chat_reply"])
    return result


if __name__ == "__main__":
    repo = Path(__file__).resolve().parents[2]
    check(Path(sys.argv[1]) if len(sys.argv) > 1 else repo / "roseinfer" / "models" / "tiny-llama-shakespeare")
