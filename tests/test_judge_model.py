"""ModelJudge: the tiny model with random weights as the judge, end to end through dense_rewards."""
import types

from flax import nnx
import numpy as np
import pytest
import tokenizers

from jaxrlvr import models
from jaxrlvr.rewards import dense
from jaxrlvr.rewards import judge as judge_lib
from jaxrlvr.rewards.judge_prompts import JudgeRequest

_SPECIAL = ["[PAD]", "[EOS]", "[UNK]"]
_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 \n.,:()-+=#*'/?<>")


def _char_tokenizer() -> tokenizers.Tokenizer:
  """A character-level tokenizer under the tiny preset's 64-token vocabulary (lower-cases its input)."""
  vocab = {t: i for i, t in enumerate(_SPECIAL + _CHARS)}
  assert len(vocab) <= models.get_preset("tiny").vocab_size
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
  tok.normalizer = tokenizers.normalizers.Lowercase()
  tok.decoder = tokenizers.decoders.Fuse()
  tok.add_special_tokens(_SPECIAL)
  return tok


def test_model_judge_end_to_end_random_model_is_a_counted_parse_failure():
  tok = _char_tokenizer()
  model = models.Transformer(models.get_preset("tiny"), rngs=nnx.Rngs(0))
  judge = judge_lib.ModelJudge(model, tok, max_new_tokens=8, batch_size=2, eos_ids=(1,), pad_id=0)
  answer = "add the units ### 7 + 5 = 12"
  ids = tok.encode(answer).ids
  group = dense.RolloutGroup(question="What is 7+5?", reference="7+5=12", token_ids=np.array([ids + [1, 0, 0]]),
                             lengths=np.array([len(ids) + 1]), finished=np.array([True]))
  out = dense.dense_rewards(judge, [group], tok, reward="process", norm="delta")
  # Two segments -> two requests in one batch of 2; random weights emit no "SCORE: k" -> both unparseable.
  m = out.metrics
  assert m["judge/requests"] == 2 and m["judge/parse_failures"] == 2 and m["judge/request_failures"] == 0
  assert m["judge/removed_rollouts"] == 1 and out.loss_mask.tolist() == [0.0]
  assert not out.advantages.any()
  # Tokens sent = the two prompts' lengths, character-level, so at least the prompt text of each.
  assert m["judge/tokens_sent"] > 2 * 1000
  assert m["judge/latency_mean_s"] > 0


def test_model_judge_batching_decoding_and_limits_with_a_stub_sampler():
  tok = _char_tokenizer()
  calls = []
  eos = 1
  replies = {"a1": "ok. score: 4", "a2": "score: 9", "a3": "fine. score: 2"}  # keyed by the graded answer

  def fake_generate(model, prompts, *, max_new_tokens, rng, temperature, eos_ids, pad_id):
    calls.append((len(prompts), temperature, tuple(eos_ids), pad_id))
    tokens = np.zeros((len(prompts), max_new_tokens), np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    for row, prompt in enumerate(prompts):
      text = tok.decode(prompt)
      reply = next(r for key, r in replies.items() if key in text)
      ids = tok.encode(reply).ids + [eos]
      tokens[row, :len(ids)] = ids
      lengths[row] = len(ids)
    return types.SimpleNamespace(tokens=tokens, lengths=lengths)

  judge = judge_lib.ModelJudge(object(), tok, max_new_tokens=20, batch_size=2, eos_ids=(eos,), pad_id=0,
                               max_prompt_tokens=1500, generate_fn=fake_generate)
  requests = [JudgeRequest("q", "r", "a1"), JudgeRequest("q", "r", "a2"), JudgeRequest("q", "r", "x" * 600),
              JudgeRequest("q", "r", "a3")]
  results = judge.score(requests)
  # 3 prompts fit -> two sampler calls, both padded to batch 2 (fixed shape), greedy.
  assert calls == [(2, 0.0, (eos,), 0), (2, 0.0, (eos,), 0)]
  assert [r.score for r in results] == [0.75, None, None, 0.25]  # 4 -> .75; 9 is no verdict; too long; 2 -> .25
  assert results[1].parse_failed and results[1].text == "score: 9"
  assert results[2].error.startswith("prompt too long") and not results[2].parse_failed
  assert results[0].tokens_sent == len(judge.prompt_ids(requests[0]))
  with pytest.raises(ValueError, match="batch_size=0"):
    judge_lib.ModelJudge(object(), tok, batch_size=0, generate_fn=fake_generate)
