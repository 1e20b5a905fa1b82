"""The embedded task, its tokenizer, prompt templates and the question iterator (jaxrlvr/data/)."""
import collections
import os

import ml_collections
import pytest
import tokenizers
import transformers

from jaxrlvr.data import (ArithmeticSource, DataError, QuestionIterator, encode, format_prompt, load_tokenizer,
                          make_source, sources_from_config, stop_token_ids, warm_start_texts)
from jaxrlvr.data import synthetic
from jaxrlvr.rewards import fast_verdict


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("cache"))
  return cache, load_tokenizer("", cache_dir=cache)


def test_arithmetic_is_deterministic_graded_and_correct():
  train = make_source("synthetic:arithmetic", split="train", seed=3)
  again = ArithmeticSource(split="train", seed=3)
  other = ArithmeticSource(split="train", seed=4)
  assert [train[i] for i in range(50)] == [again[i] for i in range(50)]
  assert [train[i].question for i in range(50)] != [other[i].question for i in range(50)]
  levels = collections.Counter(train[i].data_source for i in range(400))
  assert levels == {f"arithmetic/{name}": 100 for name in synthetic.LEVELS}  # mixed evenly: qid % 4
  for qid in range(400):
    example = train[qid]
    assert int(example.answer) == eval(example.question)  # pylint: disable=eval-used
    assert int(example.answer) >= 0
    assert example.solution.endswith(f"\\boxed{{{example.answer}}}")
    assert fast_verdict(example.solution, example.answer) == 1.0  # the reward accepts the worked solution
  assert train[2].question.count("-") == 1 and "=" in train[2].solution  # addsub2 shows its worked step
  widths = {name: set() for name in synthetic.LEVELS}
  for qid in range(400):
    example = train[qid]
    widths[example.data_source.split("/")[1]].add(tuple(len(t) for t in example.question.replace("*", "+")
                                                                        .replace("-", "+").split("+")))
  assert widths == {"add2": {(2, 2)}, "add3": {(3, 3)}, "addsub2": {(2, 2, 2)}, "mul1x2": {(1, 2)}}


def test_worked_solutions_add_column_by_column():
  # 47+38: 7+8 = 15 (carry 1), 4+3+1 = 8.  472+389: 2+9 = 11, 7+8+1 = 16, 4+3+1 = 8.  99+1: 10, 10.
  assert synthetic.column_sums(47, 38) == [15, 8]
  assert synthetic.column_sums(472, 389) == [11, 16, 8]
  assert synthetic.column_sums(99, 1) == [10, 10]
  assert synthetic._render("add2", (47, 38)) == ("47+38", "85", "15,8,\\boxed{85}")
  # 85-21: 5-1 = 4, 8-2 = 6.  94-16: 4-6 = -2 (digit 8, borrow 1), 9-1-1 = 7 -> 78.  198-99: 8-9 = -1, 9-9-1 = -1,
  # 1-0-1 = 0 -> 99.  64-64: 0, 0.
  assert synthetic.column_differences(85, 21) == [4, 6]
  assert synthetic.column_differences(94, 16) == [-2, 7]
  assert synthetic.column_differences(198, 99) == [-1, -1, 0]
  assert synthetic.column_differences(64, 64) == [0, 0]
  assert synthetic._render("addsub2", (47, 38, 21)) == ("47+38-21", "64", "15,8,85-21=4,6,\\boxed{64}")
  assert synthetic._render("addsub2", (80, 14, 16)) == ("80+14-16", "78", "4,9,94-16=-2,7,\\boxed{78}")
  # 7*38: 7*8 = 56 (carry 5), 7*3 = 21, 21+5 = 26 -> 266.
  assert synthetic._render("mul1x2", (7, 38)) == ("7*38", "266", "56,21,26,\\boxed{266}")


def test_column_differences_spell_the_answer_for_every_subtraction():
  """Every c <= s <= 198 (all that addsub2 can ask): the digits d mod 10, most significant first, spell s - c."""
  for s in range(20, 199):
    for c in range(10, min(s, 99) + 1):
      diffs = synthetic.column_differences(s, c)
      assert all(-10 <= d <= 9 for d in diffs) and diffs[-1] >= 0, (s, c, diffs)  # 100-91: 0-9-1 = -10
      assert int("".join(str(d % 10) for d in reversed(diffs))) == s - c, (s, c, diffs)


def test_worked_fraction_answers_the_rest_bare():
  """A fixed share of train questions keep their worked solution; the others get the bare boxed answer, the same
  question always the same way, and the questions and answers themselves do not change."""
  full = ArithmeticSource(split="train", seed=3, size=4000)
  mixed = ArithmeticSource(split="train", seed=3, size=4000, worked_fraction=0.4)
  worked = 0
  for qid in range(len(mixed)):
    a, b = full[qid], mixed[qid]
    assert (a.question, a.answer) == (b.question, b.answer)
    if b.solution == a.solution:
      worked += 1
    else:
      assert b.solution == f"\\boxed{{{a.answer}}}", b.solution
  # 4,000 Bernoulli(0.4) draws: mean 1,600, sd 31; 5 sd either side.
  assert 1445 <= worked <= 1755, worked
  assert mixed[17] == ArithmeticSource(split="train", seed=3, size=4000, worked_fraction=0.4)[17]
  assert all(ArithmeticSource(split="train", size=50, worked_fraction=0.0)[q].solution.startswith("\\boxed{")
             for q in range(50))
  with pytest.raises(DataError, match="worked_fraction must lie in"):
    ArithmeticSource(worked_fraction=1.5)
  with pytest.raises(DataError, match="apply to the synthetic task only"):
    make_source("jsonl:/nonexistent.jsonl", worked_fraction=0.5)
  with pytest.raises(DataError, match="apply to the synthetic task only"):
    make_source("jsonl:/nonexistent.jsonl", worked_by_level="add2=1")
  with pytest.raises(DataError, match="levels='add2' applies to the synthetic task only"):
    make_source("jsonl:/nonexistent.jsonl", levels="add2")


def test_a_mix_of_levels_of_ones_own():
  # data.levels: qids cycle through the named levels; a level named twice gets twice the questions, never the same
  # one twice; the default mix is the four levels as before, question for question.
  mix = ArithmeticSource(split="train", seed=1, size=600, levels="add1x2,add2,mul2x2,mul2x2",
                         worked_by_level="add1x2=1,mul2x2=0")
  sources = [mix[q].data_source for q in range(600)]
  assert {s: sources.count(s) for s in set(sources)} == {"arithmetic/add1x2": 150, "arithmetic/add2": 150,
                                                         "arithmetic/mul2x2": 300}
  products = [mix[q] for q in range(600) if mix[q].data_source == "arithmetic/mul2x2"]
  assert len({e.question for e in products}) == 300  # the two mul2x2 slots take alternate questions of its order
  assert all(e.solution == f"\\boxed{{{e.answer}}}" for e in products)  # worked fraction 0: bare
  assert mix[0].question.count("+") == 1 and mix[0].solution.count(",") == 2  # add1x2, worked: "d+xy" -> 2 columns
  a, b = (int(x) for x in products[0].question.split("*"))
  assert products[0].answer == str(a * b) and 10 <= a <= 99 and 10 <= b <= 99
  assert synthetic._render("mul2x2", (47, 38)) == ("47*38", "1786", "376,141,\\boxed{1786}")  # 47*8, 47*3
  default, explicit = ArithmeticSource(seed=1, size=40), ArithmeticSource(seed=1, size=40,
                                                                         levels=",".join(synthetic.LEVELS))
  assert all(default[q] == explicit[q] for q in range(40))
  # A level named twice reserves 128 test questions a slot, 256 in all: the test split holds 128 a slot of the mix,
  # none of them ever a training question; a mix without repeats keeps the split it had (the default's above).
  test = ArithmeticSource(split="test", seed=1, size=384, levels="add2,add2,mul2x2")
  assert len({test[q].question for q in range(384)}) == 384
  assert not {test[q].question for q in range(384)} & {ArithmeticSource(seed=1, size=8000, levels="add2,add2,mul2x2")[
      q].question for q in range(8000)}
  with pytest.raises(DataError, match=r"test size \(385\) must be <= 384"):
    ArithmeticSource(split="test", size=385, levels="add2,add2,mul2x2")
  # mul1x2 has 720 questions: named 6 times, its 768 reserved ones would leave none to train on.
  with pytest.raises(DataError, match=r"names 'mul1x2' 6 times: its 768 reserved test questions leave none"):
    ArithmeticSource(levels="mul1x2," * 5 + "mul1x2")
  with pytest.raises(DataError, match="unknown level"):
    ArithmeticSource(levels="add2,div2")
  with pytest.raises(DataError, match="worked_by_level"):
    ArithmeticSource(worked_by_level="add2=2")


def test_train_and_test_are_disjoint_for_any_test_size():
  largest_test = ArithmeticSource(split="test", seed=0, size=4 * synthetic.HELD_OUT_PER_SLOT)
  train = ArithmeticSource(split="train", seed=0)
  held_out = {largest_test[i].question for i in range(len(largest_test))}
  assert len(held_out) == len(largest_test)
  assert not held_out & {train[i].question for i in range(len(train))}
  assert len(ArithmeticSource(split="test", seed=0)) == 200
  with pytest.raises(DataError, match=r"test size \(513\) must be <= 512"):
    ArithmeticSource(split="test", size=513)
  with pytest.raises(DataError, match="split must be 'train' or 'test', got 'validation'"):
    ArithmeticSource(split="validation")
  with pytest.raises(DataError, match="unknown synthetic task 'algebra'"):
    make_source("synthetic:algebra")


def test_embedded_tokenizer(embedded):
  cache, tokenizer = embedded
  assert len(tokenizer) <= 64 and tokenizer.pad_token_id == 0 and tokenizer.eos_token == "<eos>"
  assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
  assert tokenizer.tokenize("\\boxed{907}") == ["\\boxed{", "9", "0", "7", "}"]  # digits one token each
  source = ArithmeticSource(split="train", seed=0, size=2000)
  longest_prompt = longest_completion = 0
  for prompt, completion in warm_start_texts(source, tokenizer=tokenizer):
    prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = tokenizer(completion)["input_ids"]
    assert tokenizer.unk_token_id not in prompt_ids + completion_ids
    assert completion_ids[-1] == tokenizer.eos_token_id  # the warm start teaches the model to stop
    assert tokenizer.decode(prompt_ids + completion_ids) == prompt + completion  # lossless round trip
    longest_prompt = max(longest_prompt, len(prompt_ids))
    longest_completion = max(longest_completion, len(completion_ids))
  # "Q: 47+38-21\nA: " is 3 + 8 + 1 + 3 = 15. The longest completion subtracts from a 3-digit sum with two borrows,
  # "18,13,138-79=-1,-5,0,\boxed{59}<eos>": sums 2+1+2+1, "138-79=" 7, diffs 2+1+2+1+1+1, answer 1+2+1, eos 1 = 26.
  assert (longest_prompt, longest_completion) == (15, 26)
  # It is an ordinary Hugging Face tokenizer directory, cached, with no staging directory left behind.
  path = os.path.join(cache, "tokenizer-v2")
  reloaded = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  assert reloaded("Q: 1+2\nA: ")["input_ids"] == tokenizer("Q: 1+2\nA: ")["input_ids"]
  stamp = os.path.getmtime(os.path.join(path, "tokenizer.json"))
  load_tokenizer("", cache_dir=cache)
  assert os.path.getmtime(os.path.join(path, "tokenizer.json")) == stamp
  assert os.listdir(cache) == ["tokenizer-v2"]


def test_encode_gives_the_tokenizers_own_ids(embedded):
  """`data.encode` asks the embedded (plain, tokenizers-backed) tokenizer's backend directly and any other class
  through its `__call__`: the ids are the tokenizer's own either way, unknown characters included."""
  _, tokenizer = embedded
  source = ArithmeticSource(split="train", seed=0, size=300)
  texts = [t for pair in warm_start_texts(source, tokenizer=tokenizer) for t in pair] + ["", "Q: 1+2=?", "<eos>7"]
  assert type(tokenizer).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")  # the backend's path
  expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
  assert encode(tokenizer, texts) == expected
  assert tokenizer.unk_token_id in expected[-2]  # '?' is not in the task's vocabulary

  class Wrapped(type(tokenizer)):  # another class: its own __call__
    pass

  wrapped = Wrapped.from_pretrained(tokenizer.name_or_path, local_files_only=True)
  assert encode(wrapped, texts) == expected


def _chat_tokenizer(path: str) -> str:
  """A small word-level tokenizer with a Qwen-like chat template, written as an HF directory."""
  words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                   eos_token="<|endoftext|>", additional_special_tokens=["<|im_end|>"])
  tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  tokenizer.save_pretrained(path)
  return path


def test_local_tokenizer_directory_chat_template_and_stops(tmp_path):
  tokenizer = load_tokenizer(_chat_tokenizer(str(tmp_path / "tok")))
  assert stop_token_ids(tokenizer) == [1, 3]  # <|endoftext|> (eos) and <|im_end|> (end of turn)
  verl = make_source("synthetic:arithmetic")[0]
  prompt = format_prompt(verl, template="chat", tokenizer=tokenizer)
  assert prompt == f"<|im_start|>user\n{verl.question}<|im_end|>\n<|im_start|>assistant\n"
  with pytest.raises(DataError, match="is not a directory"):
    load_tokenizer(str(tmp_path / "missing"))


def test_prompt_templates(embedded):
  _, tokenizer = embedded
  example = ArithmeticSource(split="test")[0]
  assert format_prompt(example, template="plain") == f"Q: {example.question}\nA: "
  # The embedded tokenizer's chat template reproduces the plain prompt, so 'chat' works on the default too.
  assert format_prompt(example, template="chat", tokenizer=tokenizer) == format_prompt(example, template="plain")
  qwen = format_prompt("What is 2+2?", template="qwen_math")
  assert qwen == ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                  "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
  r1 = format_prompt("What is 2+2?", template="r1")
  assert "<think> </think>" in r1 and r1.endswith("User: What is 2+2?\nAssistant:")
  with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
    format_prompt(example, template="chat", tokenizer=None)
  with pytest.raises(ValueError, match="tokenizer.template='alpaca' is not one of"):
    format_prompt(example, template="alpaca")


def test_iterator_epochs_hosts_exclusion_and_resume():
  source = list(range(10))  # only len() is used
  it = QuestionIterator(source, seed=1)
  first, second = it.next(10), it.next(10)
  assert sorted(first) == sorted(second) == list(range(10)) and first != second  # reshuffled per epoch
  assert QuestionIterator(source, seed=1, shuffle=False).next(12) == list(range(10)) + [0, 1]

  # Two hosts: the same permutation, alternate entries, 10 // 2 = 5 each, disjoint within an epoch.
  host0 = QuestionIterator(source, seed=1, host_id=0, num_hosts=2).next(5)
  host1 = QuestionIterator(source, seed=1, host_id=1, num_hosts=2).next(5)
  assert host0 == first[0::2] and host1 == first[1::2]
  # Three hosts: 10 // 3 = 3 each; the tenth question is left out of this epoch.
  assert len(set(sum((QuestionIterator(source, seed=1, host_id=h, num_hosts=3).next(3) for h in range(3)), []))) == 9

  # Restoring mid-epoch continues with exactly what the original would have drawn.
  it = QuestionIterator(source, seed=7)
  it.next(13)
  state = it.state_dict()
  expected = it.next(15)
  restored = QuestionIterator(source, seed=7)
  restored.load_state_dict(state)
  assert restored.next(15) == expected
  with pytest.raises(ValueError, match="saved num_hosts=1 but this iterator has num_hosts=2"):
    QuestionIterator(source, seed=7, num_hosts=2).load_state_dict(state)

  # Excluded (retired) qids are passed over; n fresh qids are still returned.
  drawn = QuestionIterator(source, seed=2).next(8, exclude={0, 1, 2})
  assert len(drawn) == 8 and not {0, 1, 2} & set(drawn)
  with pytest.raises(ValueError, match="every one of this host's 10 questions is excluded"):
    QuestionIterator(source, seed=2).next(1, exclude=set(range(10)))
  with pytest.raises(ValueError, match="10 questions cannot be split over 11 hosts"):
    QuestionIterator(source, seed=0, host_id=0, num_hosts=11)


def test_sources_from_config(tmp_path):
  path = tmp_path / "eval.jsonl"
  path.write_text('{"question": "1+1", "answer": "2"}\n')
  data = dict(source="synthetic:arithmetic", eval_source="", question_field="question", answer_field="answer",
              solution_field="solution", eval_size=40, train_size=100)
  config = ml_collections.ConfigDict({"seed": 5, "data": data})
  train, held_out = sources_from_config(config)
  assert (len(train), len(held_out)) == (100, 40)
  assert train[0] == ArithmeticSource(split="train", seed=5)[0]  # the run's seed picks the question set
  config.data.eval_source = f"jsonl:{path}"
  assert sources_from_config(config)[1][0].answer == "2"
