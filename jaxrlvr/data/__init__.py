"""Questions in, prompts out: data sources, the embedded arithmetic task, prompt templates, tokenizers."""
from jaxrlvr.data.iterator import QuestionIterator
from jaxrlvr.data.sources import DataError
from jaxrlvr.data.sources import Example
from jaxrlvr.data.sources import make_source
from jaxrlvr.data.sources import Source
from jaxrlvr.data.sources import sources_from_config
from jaxrlvr.data.synthetic import ArithmeticSource
from jaxrlvr.data.synthetic import warm_start_texts
from jaxrlvr.data.templates import format_prompt
from jaxrlvr.data.templates import stop_token_ids
from jaxrlvr.data.templates import TEMPLATES
from jaxrlvr.data.tokenizer import embedded_tokenizer_dir
from jaxrlvr.data.tokenizer import load_tokenizer
from jaxrlvr.data.tokenizer import tokenizer_from_config

__all__ = ["ArithmeticSource", "DataError", "Example", "QuestionIterator", "Source", "TEMPLATES",
           "embedded_tokenizer_dir", "format_prompt", "load_tokenizer", "make_source", "sources_from_config",
           "stop_token_ids", "tokenizer_from_config", "warm_start_texts"]
