"""tokenizer_config.json and the chat template files: what a tokenizer needs beyond its vocabulary.

A checkpoint saved by `transformers` names its special tokens and its chat template next to the vocabulary:

    tokenizer_config.json     "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", ...
                              "chat_template": "{% for message in messages %}..."   (transformers 4)
    chat_template.jinja       the same template as a file of its own (transformers 5 writes this; it wins)
    additional_chat_templates/NAME.jinja   more templates, chosen by name ("tool_use", ...)

A special token is written either as its text or as an AddedToken dict {"content": "<s>", ...}. The named
ones (`special_tokens_map`, transformers' name) are what a chat template sees as `bos_token`, `eos_token`, ...
"""

from __future__ import annotations

import json
from pathlib import Path

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES
SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def read_json(path: Path):
    """A tokenizer file's JSON; a ValueError naming the file if it is not valid JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e


def read_tokenizer_config(model_dir: Path) -> dict:
    """tokenizer_config.json as a dict ({} if the directory has none)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.exists():
        return {}
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def token_content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: "<s>" or {"content": "<s>", "lstrip": false, ...}."""
    return token.get("content") if isinstance(token, dict) else token


def special_tokens_map(config: dict, defaults: dict[str, str] | None = None) -> dict[str, str]:
    """{"bos_token": "<s>", "eos_token": "</s>", ...}: the named special tokens that are set, as transformers'
    `tokenizer.special_tokens_map` has them (a dict `extra_special_tokens` adds its names, as in transformers 5).
    `defaults` fill in names the config does not mention (GPT-2's "<|endoftext|>")."""
    names = dict(defaults or {})
    for key in SPECIAL_TOKENS_ATTRIBUTES:
        if key in config:
            names[key] = token_content(config[key])
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        names.update({k: token_content(v) for k, v in extra.items()})
    return {k: v for k, v in names.items() if isinstance(v, str)}


def extra_special_tokens(config: dict) -> list[str]:
    """The special tokens listed without a name (`additional_special_tokens`, transformers 5's
    `extra_special_tokens`): they are skipped in output text like the named ones."""
    out = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        values = extra.values() if isinstance(extra, dict) else extra
        out += [t for t in map(token_content, values) if isinstance(t, str)]
    return out


def load_chat_template(model_dir: Path, config: dict | None = None) -> str | dict[str, str] | None:
    """The model's chat template(s), found as transformers 5 finds them: chat_template.jinja and
    additional_chat_templates/*.jinja if there are such files, else tokenizer_config.json's "chat_template"
    (a string, or a list of {"name", "template"}). One template comes back as a str, several as {name: template}
    ("default" is the one used when none is named); None if the model has none."""
    model_dir = Path(model_dir)
    config = read_tokenizer_config(model_dir) if config is None else config
    files: dict[str, str] = {}
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (model_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{model_dir / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                         f"{{'name', 'template'}}, got {type(template).__name__}")  # fmt: skip
    return template
