"""SFT data: validation of conversations, assistant-only loss masks, packing, the MindRecord round trip.

The reference for the loss mask is a character-level tokenizer: token i is character i of the rendered
conversation, so the scored labels must be exactly the characters of the assistant replies, located
in the rendered text by string search (independent of how data/sft.py segments the rendering).
"""

import json

import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.data.hf_tokenizer import render_chat_template
from mindmoe.data.mindrecord import EvalLoader, WindowLoader, write_shards
from mindmoe.data.packing import label_mask
from mindmoe.data.reader import DataInputError
from mindmoe.data.sft import conversation_messages, encode_conversation, pack_conversations, read_conversations
from mindmoe.train.head_loss import masked_cross_entropy
from mindmoe.train.step import split_window

# A chat template in the style of HF ones (Jinja), closing each assistant reply with an end marker.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
    "${% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
VOCAB = 256


class CharTokenizer:
    """One token per character (code point mod 256)."""

    chat_template = TEMPLATE
    bos_id, eos_id, pad_id = -1, -1, 0

    def encode(self, text):
        return [ord(c) % VOCAB for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False):
        return render_chat_template(self.chat_template, messages, add_generation_prompt)


CONVERSATION = [
    {"role": "system", "content": "You are the order desk."},
    {"role": "user", "content": "Where is order 1042?"},
    {"role": "assistant", "content": "It shipped on 3 May."},
    {"role": "user", "content": "订单什么时候到？"},
    {"role": "assistant", "content": "预计5月6日送达。"},
]


def expected_char_mask(messages):
    """1 on the characters of each assistant reply and its closing '$' in the rendered text."""
    text = render_chat_template(TEMPLATE, messages)
    mask = np.zeros(len(text), np.int32)
    start = 0
    for message in messages:
        if message["role"] == "assistant":
            where = text.index("<assistant>" + message["content"] + "$", start) + len("<assistant>")
            mask[where : where + len(message["content"]) + 1] = 1
            start = where
    return text, mask


def test_template_conversation_scores_exactly_the_assistant_replies():
    ids, mask = encode_conversation(CONVERSATION, CharTokenizer())
    text, expected = expected_char_mask(CONVERSATION)
    assert ids.tolist() == CharTokenizer().encode(text)
    np.testing.assert_array_equal(mask, expected)


def test_loss_is_masked_outside_assistant_tokens():
    tokenizer = CharTokenizer()
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]
    encoded = [encode_conversation(CONVERSATION, tokenizer), encode_conversation(short, tokenizer)]
    seq_len = len(encoded[0][0]) + len(encoded[1][0]) + 5
    packed = pack_conversations(encoded, seq_len, tokenizer.pad_id, "error", "test").windows
    assert len(packed) == 1
    batch = {"input_ids": packed.input_ids, "doc_ids": packed.doc_ids, "loss_mask": packed.loss_mask}
    input_ids, doc_ids, labels, loss_mask = split_window(batch)

    # Reference: label t+1 is scored iff its character lies inside an assistant reply.
    first_text, first_mask = expected_char_mask(CONVERSATION)
    second_text, second_mask = expected_char_mask(short)
    char_mask = np.concatenate([first_mask, second_mask, np.zeros(5 + 1, np.int32)])
    expected = char_mask[1:].copy()
    expected[len(first_text) - 1] = 0  # the first token of conversation 2 is never predicted from conversation 1
    np.testing.assert_array_equal(loss_mask.asnumpy()[0], expected)
    assert expected.sum() == len("It shipped on 3 May.$") + len("预计5月6日送达。$") + len("hello!$")

    logits = np.random.default_rng(0).normal(size=(1, seq_len, VOCAB)).astype(np.float32)
    loss, _, count = masked_cross_entropy(Tensor(logits), labels, loss_mask)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs[0], labels.asnumpy()[0][:, None], -1)[:, 0]
    assert count.asnumpy() == expected.sum()
    np.testing.assert_allclose(loss.asnumpy(), nll[expected == 1].mean(), rtol=1e-5)


def test_default_template_for_tokenizers_without_one(tmp_path):
    class Plain(CharTokenizer):
        chat_template = None
        bos_id, eos_id = 1, 2

    ids, mask = encode_conversation(CONVERSATION[1:3], Plain())
    text = "<|user|>\nWhere is order 1042?\n<|assistant|>\nIt shipped on 3 May."
    assert ids.tolist() == [1] + Plain().encode(text) + [2]
    reply = len("It shipped on 3 May.") + 1  # and the EOS
    assert mask.tolist() == [0] * (len(ids) - reply) + [1] * reply


def test_packing_keeps_conversations_whole_and_pads_with_an_unscored_document():
    encoded = [(np.full(n, n, np.int32), np.ones(n, np.int32)) for n in (4, 5, 3, 6)]
    packed = pack_conversations(encoded, seq_len=8, pad_id=0, overlong="error", where="test").windows
    # windows of 9: [4, 5] -> 9, [3, 6] -> 9
    assert packed.input_ids.tolist() == [[4] * 4 + [5] * 5, [3] * 3 + [6] * 6]
    assert packed.doc_ids.tolist() == [[0] * 4 + [1] * 5, [0] * 3 + [1] * 6]
    packed = pack_conversations(encoded[:3], seq_len=9, pad_id=0, overlong="error", where="test").windows
    assert packed.input_ids.tolist() == [[4] * 4 + [5] * 5 + [0], [3] * 3 + [0] * 7]
    assert packed.doc_ids.tolist()[1] == [0] * 3 + [1] * 7
    assert packed.loss_mask.tolist()[1] == [1] * 3 + [0] * 7
    assert label_mask(packed)[1].tolist() == [True, True] + [False] * 7


def test_overlong_conversations_are_errors_or_counted_truncations():
    long = (np.arange(20, dtype=np.int32), np.r_[np.zeros(12), np.ones(8)].astype(np.int32))
    prompt_only = (np.arange(20, dtype=np.int32), np.r_[np.zeros(15), np.ones(5)].astype(np.int32))
    fine = (np.arange(5, dtype=np.int32), np.ones(5, np.int32))
    with pytest.raises(DataInputError, match=r"train.jsonl: conversation 1 has 20 tokens.*data.sft_overlong"):
        pack_conversations([long, fine], 11, 0, "error", "train.jsonl")
    result = pack_conversations([long, prompt_only, fine], 13, 0, "truncate", "train.jsonl")
    assert (result.truncated, result.dropped, result.conversations) == (2, 1, 2)
    assert result.windows.input_ids[0].tolist() == list(range(14))


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "line 2 is not valid JSON"),
        ('["user", "hi"]', "line 2: expected a JSON object, got list"),
        ('{"text": "hi"}', "line 2: expected 'messages' or 'prompt' and 'response'"),
        ('{"prompt": "hi"}', "line 2: a prompt/response row needs string 'prompt' and 'response'"),
        ('{"messages": []}', "line 2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "line 2: message 0: role 'bot'"),
        (
            '{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}',
            r"line 2: message 0 \(user\): content must be a non-empty string",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, '
            '{"role": "assistant", "content": "c"}]}',
            "line 2: message 1 is from the user, expected the assistant",
        ),
        ('{"messages": [{"role": "user", "content": "a"}]}', "line 2: the conversation must end with an assistant"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
            '{"role": "system", "content": "c"}]}',
            "line 2: message 2 is from the system",
        ),
    ],
)
def test_malformed_conversations_name_file_line_and_problem(tmp_path, line, message):
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"prompt": "q", "response": "a"})
    path.write_text(good + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataInputError, match=message) as raised:
        read_conversations(path, "data.train_files[0]")
    assert str(raised.value).startswith(f"data.train_files[0]: {path} line 2")


def test_prompt_response_rows_become_user_and_assistant_messages():
    assert conversation_messages({"system": "s", "prompt": "p", "response": "r"}, "x") == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "r"},
    ]


def test_loss_mask_survives_mindrecord_shards_and_both_loaders(tmp_path):
    tokenizer = CharTokenizer()
    encoded = [encode_conversation(CONVERSATION, tokenizer)] * 6
    packed = pack_conversations(encoded, len(encoded[0][0]), 0, "error", "test").windows
    shards = [str(tmp_path / name) for name in write_shards(packed, tmp_path, "train", 4)]
    batch = next(iter(WindowLoader(shards, micro_batch_size=2, global_batch_size=2, seed=0, shuffle=False)))
    np.testing.assert_array_equal(batch["loss_mask"], packed.loss_mask[:2])
    eval_batches = list(EvalLoader(shards, batch_size=4))
    assert [b["loss_mask"].shape for b in eval_batches] == [(4, packed.input_ids.shape[1])] * 2
    np.testing.assert_array_equal(eval_batches[1]["loss_mask"][2:], 0)  # padding windows score nothing


def test_bundled_business_sample_is_reproducible_and_valid(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    samples = Path(__file__).resolve().parents[2] / "data" / "samples"
    subprocess.run(
        [sys.executable, "-m", "tools.samples.generate_sft", "--out-dir", tmp_path], check=True, cwd=samples.parents[1]
    )
    for name in ("business_sft_train.jsonl", "business_sft_valid.jsonl"):
        assert (tmp_path / name).read_bytes() == (samples / name).read_bytes(), name
    train = read_conversations(samples / "business_sft_train.jsonl", "train")
    valid = read_conversations(samples / "business_sft_valid.jsonl", "valid")
    assert len(train) >= 300 and len(valid) >= 50
    chinese = sum(any("\u4e00" <= ch <= "\u9fff" for m in c for ch in m["content"]) for c in train)
    assert 0.3 < chinese / len(train) < 0.7
    train_texts = {json.dumps(c, ensure_ascii=False) for c in train}
    assert not any(json.dumps(c, ensure_ascii=False) in train_texts for c in valid), "valid must be held out"
