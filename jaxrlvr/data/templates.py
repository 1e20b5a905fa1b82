"""Prompt templates: how a question becomes the text the policy continues, and which tokens end an answer.

    plain      "Q: {question}\\nA: "                    the embedded default; base models
    qwen_math  Qwen2.5-Math chat format, system "Please reason step by step, and put your final answer within
               \\boxed{}." (written out, so it works with any tokenizer)
    r1         DeepSeek-R1-Zero style: reason inside <think> </think>, then the answer in \\boxed{}; pairs with
               `reward.require_think`. The prompt ends at "Assistant:", so the completion opens <think> itself.
    chat       the tokenizer's own chat template, applied to the verl messages when the example has them
"""
from jaxrlvr.data.types import Example

TEMPLATES = ("plain", "qwen_math", "r1", "chat")
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
R1_PREAMBLE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> tags and followed by the final answer within "
    "\\boxed{}, i.e., <think> reasoning process here </think> final answer here.")
# End-of-turn tokens of the chat formats in use (Qwen, Llama 3, Gemma, ...): generation stops on any that exist.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>", "<eos>")


def plain_prompt(question: str) -> str:
  return f"Q: {question}\nA: "


def format_prompt(example: Example | str, *, template: str, tokenizer=None) -> str:
  """The prompt text for an example (or a bare question string) under `template`."""
  question = example if isinstance(example, str) else example.question
  if template == "plain":
    return plain_prompt(question)
  if template == "qwen_math":
    return (f"<|im_start|>system\n{QWEN_MATH_SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")
  if template == "r1":
    return f"{R1_PREAMBLE}\nUser: {question}\nAssistant:"
  if template == "chat":
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
      name = getattr(tokenizer, "name_or_path", None)
      raise ValueError(f"tokenizer.template='chat' needs a tokenizer with a chat template; {name!r} has none")
    messages = None if isinstance(example, str) else example.messages
    messages = messages or [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  raise ValueError(f"tokenizer.template={template!r} is not one of {TEMPLATES}")


def stop_token_ids(tokenizer) -> list[int]:
  """Token ids that end a completion: the tokenizer's eos plus any known end-of-turn token in its vocabulary."""
  ids = set()
  eos = tokenizer.eos_token_id
  if eos is not None:
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
  vocab = tokenizer.get_vocab()
  ids.update(vocab[token] for token in _END_TOKENS if token in vocab)
  if not ids:
    raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos token and none of "
                     f"{_END_TOKENS}: generation would never stop")
  return sorted(int(i) for i in ids)
