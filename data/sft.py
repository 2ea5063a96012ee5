"""Supervised fine-tuning data: conversations -> packed windows whose loss covers assistant tokens only.

Input (``data.format=sft``): JSONL, one conversation per line, either

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "...", "system": "..."}          (system optional)

A conversation is an optional system message, then user/assistant turns alternating, starting with
the user and ending with the assistant. Anything else is an error naming the file and line.

Rendering: the tokenizer's chat template (HF ``tokenizer_config.json`` / ``chat_template.jinja``) when it
has one; otherwise :data:`DEFAULT_TEMPLATE_DOC`. The conversation is cut into segments by rendering
growing prefixes (the prompt up to each assistant reply with ``add_generation_prompt``, then the
reply); each segment is tokenised on its own, and the tokens of assistant replies (with whatever the
template closes a reply with) are the ones scored.

Packing: whole conversations, in file order, fill windows of ``seq_len + 1`` tokens; the rest of a
window is padding (its own document, never scored). Each conversation is a document, so attention
never crosses conversations. A conversation longer than a window is an error, or with
``data.sft_overlong=truncate`` is cut to the window (and dropped if no assistant token is left),
and counted.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from mindmoe.data.packing import PackedWindows, label_mask
from mindmoe.data.reader import DataInputError

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
DEFAULT_TEMPLATE_DOC = (
    "<bos> then per message '<|system|>\\n{content}\\n', '<|user|>\\n{content}\\n', "
    "'<|assistant|>\\n' + {content} + <eos>; the assistant content and <eos> are scored"
)


@dataclass
class SFTWindows:
    """Packed conversations: the windows (with ``loss_mask``) and what packing did."""

    windows: PackedWindows
    conversations: int
    truncated: int
    dropped: int
    scored_tokens: int


def read_conversations(path, config_key: str) -> List[List[dict]]:
    """Every conversation of a JSONL file, as ``[{"role", "content"}, ...]``, validated."""
    return list(iter_conversations(path, config_key))


def iter_conversations(path, config_key: str) -> Iterator[List[dict]]:
    """The conversations of a JSONL file one by one, validated; a file without one is an error once read."""
    path = Path(path)
    found = False
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            where = f"{config_key}: {path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataInputError(f"{where} is not UTF-8 ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataInputError(f"{where} is not valid JSON ({err.msg})") from None
            found = True
            yield conversation_messages(row, where)
    if not found:
        raise DataInputError(f"{config_key}: {path} holds no conversation")


def conversation_messages(row, where: str) -> List[dict]:
    """One JSONL row -> validated messages; errors say what is wrong at ``where``."""
    if not isinstance(row, dict):
        raise DataInputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataInputError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    elif "prompt" in row or "response" in row:
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str):
                raise DataInputError(
                    f"{where}: a prompt/response row needs string 'prompt' and 'response' "
                    f"('{key}' is {type(row.get(key)).__name__})"
                )
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
        if row.get("system") is not None:
            messages.insert(0, {"role": "system", "content": row["system"]})
    else:
        raise DataInputError(f"{where}: expected 'messages' or 'prompt' and 'response' (found keys {sorted(row)[:6]})")
    checked = []
    for index, message in enumerate(messages):
        item = f"{where}: message {index}"
        if not isinstance(message, dict):
            raise DataInputError(f"{item} is {type(message).__name__}, expected an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataInputError(f"{item}: role {role!r}, expected one of {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise DataInputError(f"{item} ({role}): content must be a non-empty string")
        checked.append({"role": role, "content": content})
    turns = checked[1:] if checked[0]["role"] == "system" else checked
    for index, message in enumerate(turns):
        expected = "user" if index % 2 == 0 else "assistant"
        if message["role"] != expected:
            position = index + len(checked) - len(turns)
            raise DataInputError(
                f"{where}: message {position} is from the {message['role']}, expected the "
                f"{expected} (after an optional system message, turns alternate user/assistant)"
            )
    if not turns or turns[-1]["role"] != "assistant":
        raise DataInputError(f"{where}: the conversation must end with an assistant message (nothing to learn)")
    return checked


def _template_segments(messages: Sequence[dict], render) -> List[Tuple[str, bool]]:
    """``[(text, is_assistant)]`` whose concatenation is the rendered conversation."""
    segments, done = [], ""

    def extend(text: str, scored: bool, what: str):
        nonlocal done
        if not text.startswith(done):
            raise DataInputError(
                f"the chat template renders {what} so that it no longer starts with the "
                "rendering of the messages before it; its assistant tokens cannot be located"
            )
        segments.append((text[len(done) :], scored))
        done = text

    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            extend(render(messages[:index], True), False, f"the prompt before message {index}")
        extend(render(messages[: index + 1], False), message["role"] == "assistant", f"message {index}")
    return segments


def encode_conversation(messages: Sequence[dict], tokenizer) -> Tuple[np.ndarray, np.ndarray]:
    """``(token ids, assistant mask)`` int32 of one conversation."""
    template = getattr(tokenizer, "chat_template", None)
    ids: List[int] = []
    mask: List[int] = []
    if template:
        for text, scored in _template_segments(messages, tokenizer.apply_chat_template):
            tokens = tokenizer.encode(text) if text else []
            ids += tokens
            mask += [int(scored)] * len(tokens)
    else:
        if tokenizer.bos_id >= 0:
            ids.append(tokenizer.bos_id)
            mask.append(0)
        for message in messages:
            header = tokenizer.encode(f"<|{message['role']}|>\n")
            if message["role"] == "assistant":
                body = tokenizer.encode(message["content"]) + ([tokenizer.eos_id] if tokenizer.eos_id >= 0 else [])
                ids += header + body
                mask += [0] * len(header) + [1] * len(body)
            else:
                body = tokenizer.encode(message["content"] + "\n")
                ids += header + body
                mask += [0] * (len(header) + len(body))
    return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


class ConversationPacker:
    """Whole conversations into ``seq_len + 1`` windows as they come (:meth:`add`, then :meth:`finish`);
    ``where`` names the source in errors. Counts what it truncated and dropped."""

    def __init__(self, seq_len: int, pad_id: int, overlong: str, where: str):
        self.window, self.pad_id, self.overlong, self.where = seq_len + 1, pad_id, overlong, where
        self.used = self.truncated = self.dropped = self.windows = 0
        self._current: List[Tuple[np.ndarray, np.ndarray]] = []
        self._length = 0

    def add(self, number: int, ids: np.ndarray, mask: np.ndarray) -> Optional[Tuple[np.ndarray, ...]]:
        """Conversation ``number`` (from 0); the ``(ids, doc ids, loss mask)`` row it closed, if any."""
        if len(ids) > self.window:
            if self.overlong == "error":
                raise DataInputError(
                    f"{self.where}: conversation {number + 1} has {len(ids)} tokens, more than "
                    f"data.seq_len + 1 = {self.window}; raise data.seq_len or set "
                    "data.sft_overlong=truncate"
                )
            ids, mask = ids[: self.window], mask[: self.window]
            self.truncated += 1
            if not mask[1:].any():
                self.dropped += 1
                return None
        row = self._flush() if self._length + len(ids) > self.window else None
        self._current.append((ids, mask))
        self._length += len(ids)
        self.used += 1
        return row

    def finish(self) -> Optional[Tuple[np.ndarray, ...]]:
        """The last row, if any; logs the truncations."""
        row = self._flush()
        if self.truncated:
            logger.warning(
                "%s: %d conversations longer than data.seq_len + 1 = %d truncated, %d of them dropped "
                "(no assistant token left)",
                self.where,
                self.truncated,
                self.window,
                self.dropped,
            )
        return row

    def _flush(self) -> Optional[Tuple[np.ndarray, ...]]:
        if not self._current:
            return None
        ids = np.full(self.window, self.pad_id, np.int32)
        docs = np.full(self.window, len(self._current), np.int32)  # padding is a document of its own
        mask = np.zeros(self.window, np.int32)
        start = 0
        for doc, (conv_ids, conv_mask) in enumerate(self._current):
            ids[start : start + len(conv_ids)] = conv_ids
            docs[start : start + len(conv_ids)] = doc
            mask[start : start + len(conv_ids)] = conv_mask
            start += len(conv_ids)
        self._current, self._length = [], 0
        self.windows += 1
        return ids, docs, mask


def rows_to_windows(rows: Sequence[Tuple[np.ndarray, ...]]) -> PackedWindows:
    return PackedWindows(*(np.stack(column) for column in zip(*rows, strict=True)))


def pack_conversations(
    encoded: Sequence[Tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int, overlong: str, where: str
) -> SFTWindows:
    """Whole conversations into ``seq_len + 1`` windows; ``where`` names the source in errors."""
    packer = ConversationPacker(seq_len, pad_id, overlong, where)
    rows = [packer.add(number, ids, mask) for number, (ids, mask) in enumerate(encoded)] + [packer.finish()]
    rows = [row for row in rows if row is not None]
    if not rows:
        raise DataInputError(f"{where}: no conversation left to train on")
    windows = rows_to_windows(rows)
    return SFTWindows(windows, packer.used, packer.truncated, packer.dropped, int(label_mask(windows).sum()))
