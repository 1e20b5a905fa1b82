"""Paged flat storage: contents survive deletes and compaction, float16 log-prob precision, memory per token."""
import numpy as np
import pytest

from jaxrlvr.replay.storage import LOGPROB_MIN, RolloutStore


def test_rows_keep_their_tokens_through_deletes_compaction_and_page_recycling():
  rng = np.random.default_rng(0)
  store = RolloutStore(page_tokens=64)
  kept = {}
  for i in range(300):
    n = int(rng.integers(1, 20))
    tokens = rng.integers(0, 2 ** 31 - 1, n, dtype=np.int32)
    lp = -rng.exponential(1.0, n).astype(np.float32)
    row = store.add(tokens, lp, qid=i, step=i)
    kept[row] = (tokens, lp.astype(np.float16).astype(np.float32))
    if rng.random() < 0.6:  # delete a random live row: compaction and recycling kick in along the way
      victim = int(rng.choice(list(kept)))
      store.delete(victim)
      del kept[victim]
  assert store.num_rows == len(kept) and store.live_tokens == sum(len(t) for t, _ in kept.values())
  for row, (tokens, lp) in kept.items():
    np.testing.assert_array_equal(store.tokens(row), tokens)
    np.testing.assert_array_equal(store.logprobs(row), lp)
  # Appends compact the deadest page before allocating a new one, so capacity tracks the live data.
  assert store.capacity_tokens() <= 8 / 7 * store.live_tokens + 2 * 64


def test_append_reuses_dead_space_before_growing():
  store = RolloutStore(page_tokens=100)
  rows = [store.add(np.full(10, i), np.zeros(10), qid=i, step=0) for i in range(10)]  # one full page
  for row in rows[::2]:
    store.delete(row)  # 50 dead tokens in the page
  new = store.add(np.full(30, 99), np.zeros(30), qid=99, step=1)
  assert store.capacity_tokens() == 100  # compacted in place, no second page
  assert [int(store.tokens(r)[0]) for r in rows[1::2]] == [1, 3, 5, 7, 9]
  np.testing.assert_array_equal(store.tokens(new), np.full(30, 99))


def test_row_ids_are_reused_last_freed_first_and_oldest_follows_insertion_order():
  store = RolloutStore(page_tokens=16)
  rows = [store.add(np.array([i]), np.zeros(1), qid=i, step=0) for i in range(4)]
  assert rows == [0, 1, 2, 3] and store.oldest() == 0
  store.delete(0)
  store.delete(2)
  assert store.oldest() == 1
  assert store.add(np.array([9]), np.zeros(1), qid=9, step=1) == 2  # last freed, first reused
  store.delete(1)
  store.delete(3)
  assert store.oldest() == 2 and int(store.get("qid", 2)) == 9


def test_float16_logprob_precision_and_range():
  store = RolloutStore()
  lp = np.array([0.0, -1e-4, -0.01, -1.0, -10.0, -1e5, -np.inf], np.float32)
  row = store.add(np.arange(7), lp, qid=0, step=0)
  back = store.logprobs(row)
  # float16 keeps 11 significant bits: |error| <= |x| 2^-11 (5e-4 at -1, 5e-3 at -10); beyond -65504 it clips.
  np.testing.assert_allclose(back[:5], lp[:5], rtol=2 ** -11, atol=0)
  assert back[5] == back[6] == LOGPROB_MIN
  with pytest.raises(ValueError, match="NaN"):
    store.add(np.arange(2), np.array([0.0, np.nan]), qid=1, step=3)
  with pytest.raises(ValueError, match="same length"):
    store.add(np.arange(3), np.zeros(2), qid=1, step=3)


def test_state_dict_round_trip_keeps_row_ids_free_list_and_order():
  rng = np.random.default_rng(1)
  a = RolloutStore(page_tokens=32)
  for i in range(50):
    n = int(rng.integers(1, 9))
    a.add(rng.integers(0, 100, n), -rng.random(n), qid=i, step=i, advantage=i / 10)
  for row in (3, 17, 5, 40):
    a.delete(row)
  b = RolloutStore()
  b.load_state_dict(a.state_dict())
  assert list(a.rows()) == list(b.rows()) and a.oldest() == b.oldest()
  for row in a.rows():
    np.testing.assert_array_equal(a.tokens(row), b.tokens(row))
    np.testing.assert_array_equal(a.logprobs(row), b.logprobs(row))
    assert a.get("advantage", row) == b.get("advantage", row)
  # The next rows get the same ids (reused 40, 5, 17, 3, then fresh ones) in both.
  assert [a.add(np.arange(2), np.zeros(2), qid=0, step=0) for _ in range(6)] == \
         [b.add(np.arange(2), np.zeros(2), qid=0, step=0) for _ in range(6)] == [40, 5, 17, 3, 50, 51]


def test_bytes_per_stored_token_at_most_8():
  # 3,000 rows of ~300 tokens (900k tokens) with a tenth deleted: int32 ids + float16 log-probs are 6 bytes a
  # token; pages, per-row arrays, dead space and the order queue must stay within 8 bytes per live token.
  rng = np.random.default_rng(2)
  store = RolloutStore(page_tokens=1 << 17)
  tokens = rng.integers(0, 150000, 600, dtype=np.int32)
  lp = -rng.random(600).astype(np.float32)
  rows = []
  for i in range(3000):
    n = int(rng.integers(100, 500))
    rows.append(store.add(tokens[:n], lp[:n], qid=i, step=i))
  for row in rng.choice(rows, 300, replace=False):
    store.delete(int(row))
  per_token = store.nbytes() / store.live_tokens
  assert 6.0 <= per_token <= 8.0, per_token
