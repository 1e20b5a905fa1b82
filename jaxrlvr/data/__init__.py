"""Questions in, prompts out: data sources, the embedded arithmetic task, prompt templates, tokenizers, checks.

Modules, lowest first (each imports only modules before it): types, templates, synthetic, tokenizer, sources
(the file formats), registry (make_source, sources_from_config, held-out splits), prompts (checks before a run),
iterator (imports none of them).
"""
from jaxrlvr.data.iterator import QuestionIterator
from jaxrlvr.data.prompts import check_prompts
from jaxrlvr.data.prompts import rows_without_solution
from jaxrlvr.data.prompts import warm_start_pairs
from jaxrlvr.data.registry import hold_out
from jaxrlvr.data.registry import make_source
from jaxrlvr.data.registry import sources_from_config
from jaxrlvr.data.registry import Subset
from jaxrlvr.data.sources import ListSource
from jaxrlvr.data.synthetic import ArithmeticSource
from jaxrlvr.data.synthetic import parse_levels
from jaxrlvr.data.synthetic import parse_worked_by_level
from jaxrlvr.data.synthetic import warm_start_texts
from jaxrlvr.data.templates import format_prompt
from jaxrlvr.data.templates import stop_token_ids
from jaxrlvr.data.templates import TEMPLATES
from jaxrlvr.data.tokenizer import embedded_tokenizer_dir
from jaxrlvr.data.tokenizer import encode
from jaxrlvr.data.tokenizer import load_tokenizer
from jaxrlvr.data.tokenizer import tokenizer_from_config
from jaxrlvr.data.types import DataError
from jaxrlvr.data.types import describe_row
from jaxrlvr.data.types import Example
from jaxrlvr.data.types import Source

__all__ = ["ArithmeticSource", "DataError", "Example", "ListSource", "QuestionIterator", "Source", "Subset",
           "TEMPLATES", "check_prompts", "describe_row", "embedded_tokenizer_dir", "encode", "format_prompt",
           "hold_out", "load_tokenizer", "make_source", "parse_levels", "parse_worked_by_level",
           "rows_without_solution", "sources_from_config",
           "stop_token_ids", "tokenizer_from_config", "warm_start_pairs", "warm_start_texts"]
