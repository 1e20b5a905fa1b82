"""ExpRL dense rewards (jaxrlvr/rewards/dense.py): segmentation, segment advantages, tokens, the batch entry point."""
import numpy as np
import pytest
import tokenizers

from jaxrlvr.rewards import dense
from jaxrlvr.rewards import judge as judge_lib


def _pieces(text, spans):
  return [text[a:b] for a, b in spans]


@pytest.mark.parametrize("text, expected", [
    ("no delimiter here", ["no delimiter here"]),
    ("", [""]),
    ("a ### b ### c", ["a ###", " b ###", " c"]),
    # At the end: the delimiter stays on the last segment; no empty segment after it.
    ("a ### b ###", ["a ###", " b ###"]),
    ("a ### b ###  \n", ["a ###", " b ###  \n"]),
    # At the start: a heading marker, not an empty step; it joins the first real segment.
    ("### Step 1: add ### Step 2: carry", ["### Step 1: add ###", " Step 2: carry"]),
    ("###", ["###"]),
    # Repeated: a run of delimiters is one cut, and so is a longer run of '#' (a markdown h4).
    ("a ###### b", ["a ######", " b"]),
    ("a #### b", ["a ####", " b"]),
    # A delimiter with only whitespace after it before the next one: the empty piece joins the previous segment.
    ("a ###\n\n### b", ["a ###\n\n###", " b"]),
    ("## not a cut # ## either", ["## not a cut # ## either"]),
])
def test_split_segments_tricky_strings(text, expected):
  spans = dense.split_segments(text)
  assert _pieces(text, spans) == expected
  # Contiguous and covering: concatenating the segments gives the text back.
  assert spans[0][0] == 0 and spans[-1][1] == len(text)
  assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_split_segments_other_delimiter():
  assert _pieces("x\n\ny\n\nz", dense.split_segments("x\n\ny\n\nz", "\n\n")) == ["x\n\n", "y\n\n", "z"]
  with pytest.raises(ValueError, match="delimiter=''"):
    dense.split_segments("abc", "")


# Two rollouts of one group, plus a removed one (its second score never arrived).
#   A: verdicts 2, 4, 3, 5 -> s = .25, .75, .5, 1.0
#   B: verdicts 3, 1       -> s = .5, 0.0
_SCORES = [np.array([0.25, 0.75, 0.5, 1.0]), np.array([0.5, 0.0]), np.array([1.0, np.nan])]
_KEEP = np.array([True, True, False])


def test_end_norm():
  a, b, c = dense.segment_advantages(_SCORES, _KEEP, norm="end")
  # s_t - s_T.  A: .25-1, .75-1, .5-1, 1-1.  B: .5-0, 0-0.
  np.testing.assert_allclose(a, [-0.75, -0.25, -0.5, 0.0])
  np.testing.assert_allclose(b, [0.5, 0.0])
  np.testing.assert_array_equal(c, [0.0, 0.0])


def test_delta_norm():
  a, b, c = dense.segment_advantages(_SCORES, _KEEP, norm="delta")
  # First: s_1 - s_T; then s_t - s_{t-1}.  A: .25-1, .75-.25, .5-.75, 1-.5.  B: .5-0, 0-.5.
  np.testing.assert_allclose(a, [-0.75, 0.5, -0.25, 0.5])
  np.testing.assert_allclose(b, [0.5, -0.5])
  np.testing.assert_array_equal(c, [0.0, 0.0])
  # One segment: s_1 - s_T = 0.
  np.testing.assert_allclose(dense.segment_advantages([np.array([0.75])], norm="delta")[0], [0.0])


def test_group_norm_means():
  # Pooled over the kept rollouts' segments: (.25+.75+.5+1 + .5+0) / 6 = 3 / 6 = .5; C does not count.
  a, b, c = dense.segment_advantages(_SCORES, _KEEP, norm="group")
  np.testing.assert_allclose(a, [-0.25, 0.25, 0.0, 0.5])
  np.testing.assert_allclose(b, [0.0, -0.5])
  np.testing.assert_array_equal(c, [0.0, 0.0])
  # Mean of rollout means: A 2.5/4 = .625, B .25 -> .4375.
  a, b, _ = dense.segment_advantages(_SCORES, _KEEP, norm="group", group_mean="rollouts")
  np.testing.assert_allclose(a, [-0.1875, 0.3125, 0.0625, 0.5625])
  np.testing.assert_allclose(b, [0.0625, -0.4375])
  # Each rollout's own mean: A - .625, B - .25.
  a, b, _ = dense.segment_advantages(_SCORES, _KEEP, norm="group", group_mean="trajectory")
  np.testing.assert_allclose(a, [-0.375, 0.125, -0.125, 0.375])
  np.testing.assert_allclose(b, [0.25, -0.25])
  with pytest.raises(ValueError, match="norm='median'"):
    dense.segment_advantages(_SCORES, norm="median")


def test_outcome_advantages():
  rewards, keep = np.array([1.0, 0.5, 0.0, 0.25]), np.array([True, True, True, False])
  # Kept mean (1 + .5 + 0) / 3 = .5; the removed rollout gets 0 and does not move the mean.
  np.testing.assert_allclose(dense.outcome_advantages(rewards, keep), [0.5, 0.0, -0.5, 0.0])
  # Sample std (ddof=1) of (1, .5, 0) = sqrt((.25 + 0 + .25) / 2) = .5 -> .5 / (.5 + 1e-6) = .999998.
  np.testing.assert_allclose(dense.outcome_advantages(rewards, keep, scale_by_std=True),
                             [0.999998, 0.0, -0.999998, 0.0], atol=1e-5)
  np.testing.assert_array_equal(dense.outcome_advantages(rewards, np.zeros(4, bool)), np.zeros(4))


# A hand-made vocabulary of multi-character tokens; decode = concatenation.
_VOCAB = ["<pad>", "abc", "##", "#x", "yz", "ab", "c#", "xy", "z", "<eos>"]


def _decode(ids):
  return "".join(_VOCAB[i] for i in ids if _VOCAB[i] not in ("<pad>", "<eos>"))


def test_token_segment_index_hand_made():
  # "ab" "c#" "##" "xy" "z" -> "abc###xyz", cut after "###" at char 6: segments "abc###", "xyz".
  # Token starts 0, 2, 4, 6, 8 -> segments 0, 0, 0, 1, 1.
  ids = [5, 6, 2, 7, 8]
  spans = dense.split_segments(_decode(ids))
  assert spans == [(0, 6), (6, 9)]
  np.testing.assert_array_equal(dense.token_segment_index(ids, spans, _decode), [0, 0, 0, 1, 1])
  # "abc" "##" "#x" "yz": "#x" straddles the cut (starts at char 5 < 6) and goes with the earlier segment, like the
  # delimiter; the stop token decodes to nothing and joins the last segment.
  ids = [1, 2, 3, 4, 9]
  spans = dense.split_segments(_decode(ids))
  np.testing.assert_array_equal(dense.token_segment_index(ids, spans, _decode), [0, 0, 0, 1, 1])
  adv = dense.token_advantages(ids, spans, np.array([-0.5, 0.25]), _decode, max_len=7)
  np.testing.assert_allclose(adv, [-0.5, -0.5, -0.5, 0.25, 0.25, 0.0, 0.0])


def test_token_segment_index_multibyte_split_across_tokens():
  # Byte tokens: "é" = c3 a9 and "ü" = c3 bc, each split over two tokens; text "é###ü", cut at char 4.
  pieces = [b"\xc3", b"\xa9#", b"##\xc3", b"\xbc"]

  def decode(ids):
    return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

  ids = [0, 1, 2, 3]
  spans = dense.split_segments(decode(ids))
  assert spans == [(0, 4), (4, 5)]
  # Token 2 ("##" + half of "ü") starts inside the first segment; token 3 completes "ü" at char 4.
  np.testing.assert_array_equal(dense.token_segment_index(ids, spans, decode), [0, 0, 0, 1])

  # The same bytes as a byte-level `tokenizers.Tokenizer` (bytes c3 a9 bc are the characters Ã © ¼ there): the
  # streaming path holds tokens 2-3 back until "ü" is complete and must still put token 3 in the second segment.
  vocab = {"Ã": 0, "©#": 1, "##Ã": 2, "¼": 3, "#": 4, "©": 5}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.decoder = tokenizers.decoders.ByteLevel()
  assert dense.as_decoder(tok)(ids) == "é###ü"
  np.testing.assert_array_equal(dense.token_segment_index(ids, spans, tok), [0, 0, 0, 1])


def test_token_segment_index_with_a_real_bpe_tokenizer():
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False,
                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  corpus = ["### Step 1: add the units ### Step 2: carry the one ###", "so 7 + 8 = 15 ### then 15 + 2 = 17"] * 20
  tok.train_from_iterator(corpus, trainer)
  # Non-ASCII characters the tokenizer never saw are split into byte tokens.
  text = "### Step 1: add 7 × 8 ≤ 60 ###\n### Step 2: carry ###é so 17 ###ü"
  ids = tok.encode(text).ids
  decode = dense.as_decoder(tok)
  assert decode(ids) == text and len(ids) > 20
  spans = dense.split_segments(text)
  assert len(spans) == 4
  assert dense._streamed_starts(ids, tok, decode) is not None  # the fast path ran...
  seg = dense.token_segment_index(ids, spans, tok)
  np.testing.assert_array_equal(seg, dense.token_segment_index(ids, spans, decode))  # ...and agrees with the slow
  assert (np.diff(seg) >= 0).all() and seg[0] == 0 and seg[-1] == len(spans) - 1
  # Brute force: each token's first character (from decoding prefixes) lies in the segment it was given.
  for k, s in enumerate(seg):
    start = len(decode(ids[:k]))
    lo, hi = spans[s]
    assert lo <= start < hi or (start == hi == len(text)), (k, start, spans[s])


class _ScriptedJudge(judge_lib.Judge):
  """Verdict by keyword in the graded text: good -> 5, ok -> 3, bad -> 1, ??? -> unparseable."""

  def __init__(self):
    self.requests = []

  def score(self, requests):
    self.requests.extend(requests)
    out = []
    for r in requests:
      score = next((s for word, s in (("good", 1.0), ("ok", 0.5), ("bad", 0.0)) if word in r.answer), None)
      out.append(judge_lib.JudgeResult(score=score, text="", latency_s=0.01, tokens_sent=10))
    return out


_WORDS = ["<pad>", "<eos>", "good", "ok", "bad", "???", " ###", " "]


def _word_decode(ids):
  return "".join(_WORDS[i] for i in ids if i > 1)


def _group(rows, finished, t=8):
  token_ids = np.zeros((len(rows), t), np.int32)
  for i, r in enumerate(rows):
    token_ids[i, :len(r)] = r
  return dense.RolloutGroup(question="q", reference="ref", token_ids=token_ids,
                            lengths=np.array([len(r) for r in rows]), finished=np.array(finished))


def test_dense_rewards_process_end_to_end():
  group = _group([
      [3, 6, 2, 6, 4, 1],  # "ok ###" "good ###" "bad" + eos: s = .5, 1, 0
      [2, 6, 2, 1],  # "good ###" "good": s = 1, 1
      [2, 6, 5, 1],  # "good ###" "???": unparseable -> removed
      [4, 6, 4, 6, 4, 6, 4, 6],  # no stop token: clipped, scores 0, never judged
  ], finished=[True, True, True, False])
  judge = _ScriptedJudge()
  out = dense.dense_rewards(judge, [group], _word_decode, reward="process", norm="end", judging="step")
  assert len(judge.requests) == 3 + 2 + 2  # segments of the three finished rollouts
  assert judge.requests[1].answer == "good ###" and judge.requests[1].context == "ok ###"
  np.testing.assert_array_equal(out.loss_mask, [1, 1, 0, 1])
  # Rollout 0, EndNorm: .5-0, 1-0, 0-0 per segment; tokens: [ok, ###] [good, ###] [bad, eos], then padding.
  np.testing.assert_allclose(out.advantages[0], [0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
  np.testing.assert_allclose(out.advantages[1], np.zeros(8))  # 1-1, 1-1
  np.testing.assert_allclose(out.advantages[2], np.zeros(8))  # removed
  np.testing.assert_allclose(out.advantages[3], np.zeros(8))  # clipped: all zeros, compared with itself -> 0
  m = out.metrics
  assert m["judge/requests"] == 7 and m["judge/parse_failures"] == 1 and m["judge/removed_rollouts"] == 1
  assert m["judge/clipped_rollouts"] == 1 and m["judge/tokens_sent"] == 70
  assert m["judge/segments_per_answer"] == (3 + 2 + 2 + 4) / 4
  # Judge scores that arrived: .5, 1, 0, 1, 1, 1 -> 4.5 / 6 = .75.
  assert m["judge/score_mean"] == pytest.approx(0.75)

  # GroupNorm, pooled over the kept rollouts (0, 1 and the clipped 3): (.5+1+0 + 1+1 + 0*4) / 9 = 3.5/9.
  out = dense.dense_rewards(_ScriptedJudge(), [group], _word_decode, reward="process", norm="group",
                            judging="step")
  mean = 3.5 / 9
  np.testing.assert_allclose(out.advantages[0, :6], np.repeat([0.5 - mean, 1.0 - mean, 0.0 - mean], 2), rtol=1e-6)
  np.testing.assert_allclose(out.advantages[3], np.full(8, -mean), rtol=1e-6)


def test_dense_rewards_outcome_two_groups():
  g1 = _group([[2, 1], [3, 1], [5, 1]], finished=[True, True, True])  # 1, .5, unparseable
  g2 = _group([[4, 1], [2, 2, 2, 2, 2, 2, 2, 2]], finished=[True, False])  # 0, clipped -> 0
  out = dense.dense_rewards(_ScriptedJudge(), [g1, g2], _word_decode, reward="outcome")
  # Group 1 kept mean (1 + .5) / 2 = .75 -> +.25, -.25 on both tokens (answer + eos). Group 2: mean 0 -> 0, 0.
  np.testing.assert_allclose(out.advantages[:, :2], [[0.25, 0.25], [-0.25, -0.25], [0, 0], [0, 0], [0, 0]])
  assert not out.advantages[:, 2:].any()
  np.testing.assert_array_equal(out.loss_mask, [1, 1, 0, 1, 1])
  np.testing.assert_allclose(out.rewards, [1.0, 0.5, 0.0, 0.0, 0.0])
  assert out.metrics["judge/requests"] == 4 and out.metrics["judge/segments_per_answer"] == 1.0


def test_dense_rewards_rejects_bad_inputs():
  g = _group([[2, 1]], finished=[True])
  with pytest.raises(ValueError, match="norm='mean'"):
    dense.dense_rewards(_ScriptedJudge(), [g], _word_decode, reward="process", norm="mean")
  with pytest.raises(ValueError, match="group 1 token_ids"):
    dense.dense_rewards(_ScriptedJudge(), [g, _group([[2, 1]], [True], t=5)], _word_decode)


def test_dense_reward_kwargs_from_config():
  import ml_collections  # pylint: disable=g-import-not-at-top
  cfg = ml_collections.ConfigDict({"reward": "process", "norm": "group", "group_mean": "rollouts",
                                   "delimiter": "###", "scale_by_std": False})
  assert dense.dense_reward_kwargs(cfg) == {"reward": "process", "norm": "group", "group_mean": "rollouts",
                                            "delimiter": "###", "scale_by_std": False, "judging": "prefix"}
  cfg.norm = "endnorm"
  with pytest.raises(ValueError, match="exprl.norm='endnorm'"):
    dense.dense_reward_kwargs(cfg)
