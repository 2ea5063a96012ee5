"""Generate the bundled sample corpus: Chinese and English business documents.

The corpus exists so that ``mindmoe-train`` with no arguments has something
realistic to learn from on a laptop: documents with recurring structure
(headings, numbered sections, bullet lists, tables written as lines) and
internally consistent numbers (line items that add up to the invoice total,
growth rates that match the two quarters they compare, due dates that follow
from payment terms). A tiny transformer can learn that structure; the slots
(companies, people, products, cities, dates, amounts) vary enough that it
cannot simply memorise the documents.

Only the standard library is used and every random choice comes from one
seeded ``random.Random``, so the output is byte-identical on every run:
``python -m tools.samples.generate_corpus`` (from the repository root) rewrites
``data/samples/corpus_{train,valid}.jsonl``; the document families live in ``tools/samples/corpus/``.
"""

import argparse
import json
import random
from pathlib import Path

from tools.samples.corpus.hr_memo import hr_memo
from tools.samples.corpus.invoice import invoice
from tools.samples.corpus.locales import Chinese, English
from tools.samples.corpus.meeting_minutes import meeting_minutes
from tools.samples.corpus.product_announcement import product_announcement
from tools.samples.corpus.quarterly_report import quarterly_report
from tools.samples.corpus.release_notes import release_notes
from tools.samples.corpus.supplier_email import supplier_email
from tools.samples.corpus.support_ticket import support_ticket

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "data" / "samples"
TRAIN_FILE = "corpus_train.jsonl"
VALID_FILE = "corpus_valid.jsonl"
TRAIN_SEED = 20240611
VALID_SEED = 7919
TRAIN_BYTES = 2_300_000
VALID_BYTES = 125_000


DOCUMENT_KINDS = [
    quarterly_report,
    meeting_minutes,
    product_announcement,
    support_ticket,
    invoice,
    hr_memo,
    supplier_email,
    release_notes,
]


def documents(seed, target_bytes):
    """Documents alternating English/Chinese until their JSONL encoding reaches ``target_bytes``."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < target_bytes:
        loc = (English if len(lines) % 2 == 0 else Chinese)(rng)
        text = rng.choice(DOCUMENT_KINDS)(rng, loc)
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        lines.append(line)
        size += len(line.encode("utf-8"))
    return lines


def generate(out_dir):
    """Write the train and validation corpora into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, seed, target in [(TRAIN_FILE, TRAIN_SEED, TRAIN_BYTES), (VALID_FILE, VALID_SEED, VALID_BYTES)]:
        path = out_dir / name
        path.write_bytes("".join(documents(seed, target)).encode("utf-8"))
        paths.append(path)
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir",
        default=str(SAMPLES_DIR),
        help="directory for corpus_train.jsonl and corpus_valid.jsonl (default: data/samples/)",
    )
    generate(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
