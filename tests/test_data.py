import json

import numpy as np
import pytest

from hylora.core.errors import DataError
from hylora.data.sources import IGNORE_INDEX, Packer, SyntheticSource, TokenFileSource


class ListSource:

  def __init__(self, docs):
    self.docs = [np.asarray(d, np.int32) for d in docs]

  def documents(self, start=0):
    i = start
    while True:
      yield self.docs[i % len(self.docs)]
      i += 1


def test_packing_segments_labels_positions():
  packer = Packer(ListSource([[1, 2, 3], [4, 5], [6, 7, 8, 9]]), seq_len=8)
  row = packer.next_row()
  # [1 2 3][4 5] fit; [6 7 8 9] does not fit the 3 slots left and fits a row: next row.
  np.testing.assert_array_equal(row["tokens"], [1, 2, 3, 4, 5, 0, 0, 0])
  np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 0, 0, 0])
  np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(row["labels"], [2, 3, IGNORE_INDEX, 5] + [IGNORE_INDEX] * 4)
  row = packer.next_row()
  np.testing.assert_array_equal(row["tokens"][:4], [6, 7, 8, 9])


def test_long_document_is_cut_and_positions_continue():
  packer = Packer(ListSource([list(range(1, 12))]), seq_len=4)
  rows = [packer.next_row() for _ in range(3)]
  np.testing.assert_array_equal(rows[1]["tokens"], [5, 6, 7, 8])
  np.testing.assert_array_equal(rows[1]["positions"], [4, 5, 6, 7])
  # Row 3 ends the document and starts its next copy, cut after one token.
  np.testing.assert_array_equal(rows[2]["tokens"], [9, 10, 11, 1])
  np.testing.assert_array_equal(rows[2]["segment_ids"], [1, 1, 1, 2])
  assert packer.position == (1, 1)


def test_resume_from_position_gives_the_same_stream():
  source = SyntheticSource(vocab_size=64, seed=3)
  a = Packer(source, seq_len=32)
  first = [a.next_row() for _ in range(3)]
  again = [Packer(source, seq_len=32).next_row()]
  np.testing.assert_array_equal(first[0]["tokens"], again[0]["tokens"])
  mid = a.position
  after = a.next_row()
  resumed = Packer(source, seq_len=32, position=mid).next_row()
  np.testing.assert_array_equal(after["tokens"], resumed["tokens"])


def test_token_files(tmp_path):
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text(json.dumps([1, 2, 3]) + "\n" + json.dumps({"tokens": [4, 5]}) + "\n")
  docs = TokenFileSource(str(jsonl), vocab_size=10).documents()
  assert list(next(docs)) == [1, 2, 3] and list(next(docs)) == [4, 5]
  npy = tmp_path / "docs.npy"
  np.save(npy, np.arange(12).reshape(3, 4))
  assert list(next(TokenFileSource(str(npy), vocab_size=20).documents(2))) == [8, 9, 10, 11]


@pytest.mark.parametrize("content, message", [
    ("[1, 2, 300]\n", "token id 300 is outside the vocabulary"),
    ("[1, -1]\n", "token id -1 is outside the vocabulary"),
    ("{bad json\n", "not valid JSON"),
    ('{"text": "hi"}\n', "expected a list of token ids"),
    ("[]\n", "empty document"),
])
def test_bad_token_files_name_the_line(tmp_path, content, message):
  path = tmp_path / "bad.jsonl"
  path.write_text("[1, 2]\n" + content)
  with pytest.raises(DataError, match=message) as info:
    TokenFileSource(str(path), vocab_size=256)
  assert "bad.jsonl:2" in str(info.value)


def test_missing_and_unsupported_files(tmp_path):
  with pytest.raises(DataError, match="does not exist"):
    TokenFileSource(str(tmp_path / "nope.jsonl"), 10)
  (tmp_path / "x.txt").write_text("1 2 3")
  with pytest.raises(DataError, match="unsupported file type"):
    TokenFileSource(str(tmp_path / "x.txt"), 10)
