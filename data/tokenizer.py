"""SentencePiece tokenizer: train one on the corpus, or load a ``.model`` file.

Training settings and why:

- BPE with ``byte_fallback``: any character outside the vocabulary becomes its
  UTF-8 bytes instead of ``<unk>``, so every text round-trips exactly.
- ``character_coverage=0.9995``: the usual setting for Chinese, whose long tail
  of rare characters would otherwise take most of a small vocabulary.
- ``identity`` normalisation and ``remove_extra_whitespaces=False``: the default
  NFKC rule rewrites full-width Chinese punctuation (``，`` becomes ``,``) and
  collapses spaces and newlines, so decode(encode(text)) would not give back text.
- ``"\\n"`` is a user-defined piece: business documents are lists, tables and
  paragraphs, and the line structure is most of what a small model can learn.
- ``split_digits``: numbers are read digit by digit, which makes sums and dates
  learnable instead of memorising each number as its own token.
- One thread, a fixed sampling seed, and the model written from memory (a file
  written by the trainer records its own path), so the same corpus gives a
  byte-identical model, and the cache keys derived from its hash are stable.
"""

import io
import logging
import re
import time
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence, Union

import sentencepiece as spm

logger = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Longest training "sentence" in bytes (the trainer's max_sentence_length); longer documents are
# fed in line-aligned chunks, longer lines in pieces.
MAX_SENTENCE_BYTES = 16384
# Sentences sampled for training; bounds time and memory on large corpora.
INPUT_SENTENCE_SIZE = 1_000_000
TRAINING_SEED = 0


class Tokenizer:
    """A loaded SentencePiece model. Picklable, so the tokenising worker processes can use it."""

    def __init__(self, path: Union[str, Path]):
        self.path = str(path)
        self._processor = spm.SentencePieceProcessor(model_file=self.path)

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._processor.bos_id()

    @property
    def eos_id(self) -> int:
        return self._processor.eos_id()

    @property
    def pad_id(self) -> int:
        return self._processor.pad_id()

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` without BOS/EOS."""
        return self._processor.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._processor.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


def load_tokenizer(path: Union[str, Path], config_key: str = "data.tokenizer") -> Tokenizer:
    """Load a SentencePiece ``.model``; errors name ``config_key`` and the path."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{config_key}: sentencepiece model not found: {path}")
    try:
        return Tokenizer(path)
    except (RuntimeError, OSError) as err:
        raise ValueError(f"{config_key}: {path} is not a sentencepiece model ({err})") from None


def _training_sentences(texts: Iterable[str]) -> Iterator[str]:
    """Whole documents, so pieces learn how text looks after a newline as well as
    at a document start. The trainer silently drops sentences over MAX_SENTENCE_BYTES
    (and fails when none is left, e.g. on a corpus of single-line documents), so longer
    documents are cut at line ends, and longer lines into pieces of their own."""
    for text in texts:
        if len(text.encode("utf-8")) <= MAX_SENTENCE_BYTES:
            yield text
            continue
        chunk: List[str] = []
        size = 0
        for line in text.split("\n"):
            line_bytes = len(line.encode("utf-8")) + 1
            if chunk and size + line_bytes > MAX_SENTENCE_BYTES:
                yield "\n".join(chunk)
                chunk, size = [], 0
            if line_bytes > MAX_SENTENCE_BYTES:
                yield from _line_pieces(line)
                continue
            chunk.append(line)
            size += line_bytes
        if chunk:
            yield "\n".join(chunk)


def _line_pieces(line: str) -> Iterator[str]:
    """``line`` in pieces of at most MAX_SENTENCE_BYTES, each cut before a space in its second
    half if there is one (so words stay whole), else between two characters."""
    data = line.encode("utf-8")
    start = 0
    while len(data) - start > MAX_SENTENCE_BYTES:
        end = start + MAX_SENTENCE_BYTES
        while data[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte: inside a character
            end -= 1
        space = data.rfind(b" ", start + MAX_SENTENCE_BYTES // 2, end)
        end = space if space > start else end
        yield data[start:end].decode("utf-8")
        start = end
    yield data[start:].decode("utf-8")


def train_sentencepiece(texts: Iterable[str], vocab_size: int, out_prefix: Union[str, Path]) -> Path:
    """Train a BPE model on ``texts`` (one document each); returns ``<out_prefix>.model``.

    Raises ``ValueError`` naming ``vocab_size`` when the corpus cannot fill the
    vocabulary or the vocabulary cannot hold the corpus' characters.
    """
    model = io.BytesIO()
    started = time.perf_counter()
    spm.set_random_generator_seed(TRAINING_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_sentences(texts),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=0.9995,
            byte_fallback=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            user_defined_symbols=["\n"],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=MAX_SENTENCE_BYTES,
            input_sentence_size=INPUT_SENTENCE_SIZE,
            shuffle_input_sentence=True,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as err:
        # SentencePiece prefixes its message with the failed C++ check; keep the sentence.
        reason = re.sub(r"^.*\] ", "", str(err).strip())
        raise ValueError(f"vocab_size={vocab_size}: {reason}") from None
    out_prefix = Path(out_prefix)
    model_path = out_prefix.with_name(out_prefix.name + ".model")
    model_path.write_bytes(model.getvalue())
    logger.info("trained a %d-piece BPE tokenizer in %.1f s", vocab_size, time.perf_counter() - started)
    return model_path
