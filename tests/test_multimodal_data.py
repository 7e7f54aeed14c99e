"""Conversation data: chat template, assistant-only loss, packing with images, seeded
order, resume, host sharding, and bad input named by record."""

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

from hylora.data import ConversationLoader, is_conversation_file
from hylora.data.images import choose_grid, tile_count
from hylora.core.errors import ConfigError, DataError
from hylora.data.sources import IGNORE_INDEX
from tests.helpers import small_config

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|image|>", "<|endoftext|>"]
WORDS = SPECIALS + ["[UNK]", "system", "user", "assistant", "what", "is", "this", "a", "cat", "."
                   ] + [f"w{i}" for i in range(200)]
ID = {w: i for i, w in enumerate(WORDS)}
TPT = small_config().model.vision.tokens_per_tile  # 4 image tokens per tile


def write_tokenizer(path):
  tok = Tokenizer(models.WordLevel(dict(ID), unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(SPECIALS)
  tok.save(str(path))


def write_image(path, width, height, seed=0):
  pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
  Image.fromarray(pixels).save(path)


def chat(user, assistant, image=None, system=None):
  content = ([{"type": "image", "path": image}] if image else []) + [{"type": "text", "text": user}]
  messages = [{"role": "system", "content": system}] if system else []
  return {
      "messages":
          messages + [{
              "role": "user",
              "content": content
          }, {
              "role": "assistant",
              "content": assistant
          }]
  }


def write_data(folder, records):
  write_tokenizer(folder / "tokenizer.json")
  path = folder / "data.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def config(**train):
  return small_config(**train)


def loader(path, cfg=None, **kw):
  return ConversationLoader(path, cfg or config(), threads=2, **kw)


def segments(batch):
  """[(row, [positions of one example])] in order."""
  out = []
  for r, seg in enumerate(batch["segment_ids"]):
    for s in range(1, seg.max() + 1):
      out.append((r, np.flatnonzero(seg == s)))
  return out


def text_records(lengths):
  """Plain-text records; the first word `w<i>` names record i."""
  return [{"text": " ".join([f"w{i}"] + [f"w{100 + i}"] * (n - 1))} for i, n in enumerate(lengths)]


def test_chat_template_loss_mask_and_image_placeholders(tmp_path):
  write_image(tmp_path / "cat.png", 20, 12)  # 2x1 grid + thumbnail = 3 tiles
  path = write_data(tmp_path, [chat("what is this", "a cat .", image="cat.png", system="w1 w2")])
  # 5 tile slots: the next copy of the record (3 more tiles) must wait for the next row.
  batch = loader(path, config(tiles_per_row=5)).next_batch(1)
  n = int((batch["segment_ids"][0] > 0).sum())
  tokens, labels = batch["tokens"][0, :n], batch["labels"][0, :n]
  im = 3 * TPT * [ID["<|image|>"]]
  expected = ([ID["<|im_start|>"], ID["system"], ID["w1"], ID["w2"], ID["<|im_end|>"]] +
              [ID["<|im_start|>"], ID["user"]] + im +
              [ID["what"], ID["is"], ID["this"], ID["<|im_end|>"]] +
              [ID["<|im_start|>"], ID["assistant"], ID["a"], ID["cat"], ID["."], ID["<|im_end|>"]])
  np.testing.assert_array_equal(tokens, expected)
  # Targets: exactly the assistant's words and its closing <|im_end|>.
  targets = [(i + 1, int(l)) for i, l in enumerate(labels) if l != IGNORE_INDEX]
  start = n - 4
  assert targets == [(start + j, expected[start + j]) for j in range(4)]
  # Image tokens: one block of TPT per tile, exactly at the placeholders.
  placed = batch["image_positions"][0]
  used = placed[placed[:, 0] >= 0]
  assert used.shape == (3, TPT) and (placed[3:] == -1).all()
  np.testing.assert_array_equal(np.sort(used.ravel()), np.flatnonzero(tokens == ID["<|image|>"]))
  assert batch["images"][0, :3].any() and not batch["images"][0, 3:].any()


def test_tile_grid_follows_image_shape():
  v = small_config().model.vision  # 16-pixel tiles, at most 4
  assert choose_grid(16, 16, 16, 4) == (1, 1) and tile_count(10, 10, v) == 1
  assert choose_grid(20, 12, 16, 4) == (1, 2) and tile_count(20, 12, v) == 3
  assert choose_grid(12, 40, 16, 4) == (3, 1)
  assert choose_grid(200, 200, 16, 4) == (2, 2) and tile_count(200, 200, v) == 5


def test_plain_text_is_trained_everywhere_and_ends_the_document(tmp_path):
  path = write_data(tmp_path, [{"text": "w5 w6 w7"}])
  batch = loader(path).next_batch(1)
  np.testing.assert_array_equal(batch["tokens"][0, :4],
                                [ID["w5"], ID["w6"], ID["w7"], ID["<|endoftext|>"]])
  np.testing.assert_array_equal(batch["labels"][0, :4],
                                [ID["w6"], ID["w7"], ID["<|endoftext|>"], IGNORE_INDEX])


def test_packing_keeps_examples_whole_and_counts_truncation(tmp_path):
  lengths = [5, 30, 63, 64, 70, 12, 40, 8, 25, 100, 3, 50]  # + 1 end-of-text token each
  path = write_data(tmp_path, text_records(lengths))
  data = loader(path)
  seen, order = {}, 0  # segments in row order are the stream's examples in order
  while order < len(lengths):
    batch = data.next_batch(2)
    for row, where in segments(batch):
      tokens = batch["tokens"][row, where]
      if order < len(lengths):  # the first epoch
        i = int(tokens[0]) - ID["w0"]
        assert i not in seen, "an example appears twice in one epoch"
        seen[i] = tokens
      order += 1
      assert (batch["positions"][row, where] == np.arange(len(where))).all()
      # Labels never cross into the next example.
      assert batch["labels"][row, where[-1]] == IGNORE_INDEX
  assert sorted(seen) == list(range(len(lengths)))
  for i, n in enumerate(lengths):
    full = [ID[f"w{i}"]] + [ID[f"w{100 + i}"]] * (n - 1) + [ID["<|endoftext|>"]]
    np.testing.assert_array_equal(seen[i], full[:64])  # whole, or cut to one row
  assert data.truncated >= sum(n + 1 > 64 for n in lengths) == 3


def test_tile_slots_bound_a_row(tmp_path):
  write_image(tmp_path / "big.png", 64, 64)  # 2x2 grid + thumbnail = 5 tiles
  records = [chat("w1", "w2", image="big.png") for _ in range(3)]
  path = write_data(tmp_path, records)
  batch = loader(path, config(tiles_per_row=8)).next_batch(2)
  # Two examples of 5 tiles cannot share a row of 8 slots, although their tokens would.
  assert (batch["segment_ids"].max(axis=1) == 1).all()
  assert ((batch["image_positions"][:, :, 0] >= 0).sum(axis=1) == 5).all()


def test_same_seed_same_batches_and_another_seed_differs(tmp_path):
  path = write_data(tmp_path, text_records(range(3, 40)))
  a, b = loader(path), loader(path)
  c = loader(path, config(seed=1))
  for _ in range(3):
    x, y, z = a.next_batch(2), b.next_batch(2), c.next_batch(2)
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])
  assert not np.array_equal(x["tokens"], z["tokens"])


def test_resume_mid_epoch_continues_with_the_next_unseen_example(tmp_path):
  write_image(tmp_path / "cat.png", 20, 12)
  records = text_records(range(3,
                               30)) + [chat(f"w{i}", "a cat", image="cat.png") for i in range(10)]
  path = write_data(tmp_path, records)
  first = loader(path)
  for _ in range(3):
    first.next_batch(2)
  state = json.loads(json.dumps(first.state()))  # plain ints: checkpointable as is
  assert 0 < state["next_example"] < len(records)
  expected = [first.next_batch(2) for _ in range(2)]
  resumed = loader(path)
  resumed.restore(state)
  for want in expected:
    got = resumed.next_batch(2)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  assert resumed.state() == first.state()


def test_hosts_read_disjoint_shares_of_the_epoch(tmp_path):
  n = 24
  path = write_data(tmp_path, text_records([4] * n))
  firsts = []
  for host in (0, 1):
    data = loader(path, process_index=host, process_count=2)
    batch = data.next_batch(2)  # this host's row of a global batch of 2
    assert batch["tokens"].shape == (1, 64)  # 12 examples of 5 tokens fill it
    firsts.append({int(batch["tokens"][r, w[0]]) for r, w in segments(batch)})
    assert data.next_example == len(firsts[-1])
  assert not firsts[0] & firsts[1]
  assert len(firsts[0] | firsts[1]) == n  # 12 per host: the whole epoch


def test_tile_slots_must_hold_the_largest_image():
  with pytest.raises(ConfigError, match="train.tiles_per_row: 4 slots"):
    config(tiles_per_row=4).validate()  # 4 tiles + thumbnail need 5
  config(tiles_per_row=0).validate()  # text-only rows


def test_is_conversation_file(tmp_path):
  (tmp_path / "ids.jsonl").write_text("[1, 2, 3]\n")
  (tmp_path / "conv.jsonl").write_text(json.dumps({"text": "w1"}) + "\n")
  assert is_conversation_file(str(tmp_path / "conv.jsonl"))
  assert not is_conversation_file(str(tmp_path / "ids.jsonl"))


BAD = [
    ("missing image", chat("w1", "w2", image="nowhere.png"), "image .*nowhere.png does not exist"),
    ("unreadable image", chat("w1", "w2", image="broken.png"), "broken.png cannot be read"),
    ("no text", {
        "text": "  "
    }, "record has no text"),
    ("image only", {
        "messages": [{
            "role": "user",
            "content": [{
                "type": "image",
                "path": "ok.png"
            }]
        }]
    }, "record has no text"),
    ("beyond vocabulary", {
        "text": "w1 w150"
    }, "'w150' has id 164, outside the model vocabulary"),
    ("image too large", chat("w1", "w2", image="huge.png"),
     "huge.png is 300x10, larger than model.vision.max_image_side=256"),
    ("not json", "{oops", "not valid JSON"),
    ("placeholder in text", {
        "text": "w1 <|image|> w2"
    }, "contains the image placeholder"),
]


def _bad_setup(tmp_path, record):
  write_image(tmp_path / "ok.png", 16, 16)
  write_image(tmp_path / "huge.png", 300, 10)
  (tmp_path / "broken.png").write_bytes(b"not an image at all")
  good = {"text": "w1 w2"}
  path = write_data(tmp_path, [good, good, good])
  line = record if isinstance(record, str) else json.dumps(record)
  with open(path, "a") as f:
    f.write(line + "\n")  # the bad record is line 4
  cfg = config()
  return path, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=150))


@pytest.mark.parametrize("name,record,message", BAD, ids=[b[0] for b in BAD])
def test_bad_record_is_named_or_skipped_and_counted(tmp_path, name, record, message):
  path, cfg = _bad_setup(tmp_path, record)
  with pytest.raises(DataError, match=f"data.jsonl:4: .*{message}"):
    data = loader(path, cfg)
    for _ in range(2):
      data.next_batch(1)
  skipping = loader(
      path, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, skip_bad_records=True)))
  batch = skipping.next_batch(1)  # several epochs of 4 records: one bad in each
  assert skipping.skipped == skipping.next_example // 4 >= 1
  assert batch["segment_ids"].max() == skipping.next_example - skipping.skipped
