"""The tokenizer of a HF checkpoint directory, with the interface of :class:`data.tokenizer.Tokenizer`.

``tokenizer.json`` is loaded with ``tokenizers`` (no transformers at run time); a directory
with only a sentencepiece ``tokenizer.model`` falls back to :func:`data.tokenizer.load_tokenizer`.
Special tokens and the chat template come from ``tokenizer_config.json`` (or
``chat_template.jinja``, where newer transformers save it). The template is a Jinja program
shipped with the checkpoint, so it is rendered in Jinja's immutable sandbox, as transformers does.
Opening either kind of tokenizer by path, and copying one, is :mod:`data.tokenizer_files`.
"""

import json
from datetime import datetime
from pathlib import Path
from typing import List, Optional, Sequence, Union

from tokenizers import Tokenizer as FastTokenizer

from mindmoe.data.tokenizer import Tokenizer as SentencePieceTokenizer
from mindmoe.data.tokenizer import load_tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SENTENCEPIECE_FILE = "tokenizer.model"


class HFTokenizer:
    """A ``tokenizer.json`` tokenizer. ``encode`` adds no special tokens (callers add BOS/EOS)."""

    def __init__(self, directory: Union[str, Path]):
        self.directory = Path(directory)
        self.path = str(self.directory / TOKENIZER_JSON)
        self._tokenizer = FastTokenizer.from_file(self.path)
        config = _tokenizer_config(self.directory)
        self.chat_template = _chat_template(self.directory, config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        model_config = _json_file(self.directory / "config.json")
        self.bos_id = self._id(self.bos_token, model_config.get("bos_token_id"))
        self.eos_id = self._id(self.eos_token, model_config.get("eos_token_id"))
        self.pad_id = self._id(self.pad_token, model_config.get("pad_token_id"))

    def _id(self, token: Optional[str], fallback) -> int:
        """The token's id, else the model config's id (the first of a list), else -1 like sentencepiece."""
        if token is not None:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        if isinstance(fallback, list):
            fallback = fallback[0] if fallback else None
        return fallback if isinstance(fallback, int) else -1

    def __getstate__(self):
        return {"directory": str(self.directory)}

    def __setstate__(self, state):
        self.__init__(state["directory"])

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [item.ids for item in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the checkpoint's chat template renders it."""
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class HFSentencePieceTokenizer(SentencePieceTokenizer):
    """A HF directory's sentencepiece ``tokenizer.model``, plus its chat template."""

    def __init__(self, path: Union[str, Path], chat_template: Optional[str] = None):
        super().__init__(path)
        self.chat_template = chat_template

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        piece = self._processor.id_to_piece
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=piece(self.bos_id) if self.bos_id >= 0 else "",
            eos_token=piece(self.eos_id) if self.eos_id >= 0 else "",
        )


def load_hf_tokenizer(path: Union[str, Path], config_key: str = "model.pretrained"):
    """The tokenizer of a HF checkpoint directory; errors name ``config_key`` and the directory."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{config_key}: {directory} is not a directory")
    if (directory / TOKENIZER_JSON).is_file():
        try:
            return HFTokenizer(directory)
        except Exception as err:  # tokenizers raises its own Exception type for bad files
            raise ValueError(f"{config_key}: {directory / TOKENIZER_JSON} cannot be loaded ({err})") from None
    if (directory / SENTENCEPIECE_FILE).is_file():
        tokenizer = load_tokenizer(directory / SENTENCEPIECE_FILE, config_key)
        template = _chat_template(directory, _tokenizer_config(directory))
        return HFSentencePieceTokenizer(tokenizer.path, template)
    raise FileNotFoundError(f"{config_key}: {directory} has neither {TOKENIZER_JSON} nor {SENTENCEPIECE_FILE}")


def render_chat_template(
    template: Optional[str], messages: Sequence[dict], add_generation_prompt: bool = False, **special_tokens
) -> str:
    """Render a HF chat template (Jinja, sandboxed) for ``messages`` (``[{"role", "content"}, ...]``)."""
    if not template:
        raise ValueError("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: Jinja's own escapes HTML characters, which would change prompts.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # The environment transformers 4.57.1 renders chat templates in (minus its {% generation %} tag).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **special_tokens
    )


def _json_file(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    return value if isinstance(value, dict) else {}


def _tokenizer_config(directory: Path) -> dict:
    return _json_file(directory / TOKENIZER_CONFIG)


def _chat_template(directory: Path, config: dict) -> Optional[str]:
    template_file = directory / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token) -> Optional[str]:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
