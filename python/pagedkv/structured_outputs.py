"""Structured outputs (vLLM's `structured_outputs`): constrain a request's tokens to a JSON schema, a regex, a
choice of strings or an EBNF grammar.

A constraint is compiled once, with the tokenizer's vocabulary, into a
grammar whose matcher knows, at every step, which tokens may come next
(xgrammar, the engine vLLM and SGLang use). Each sample of the request gets
its own matcher: before a pick the sampler masks every token the matcher
forbids (`apply_token_masks`: one bit per vocabulary entry, filled in C++ per
row), and the scheduler feeds it each token the sample takes. When the
grammar is complete only the end-of-sequence tokens remain, so the sample
stops there; a sample that reaches max_tokens first stops by length with an
incomplete text, as in vLLM.

Compiling needs the tokenizer: the in-process engine compiles in
`add_request`; with the engine core in its own process the front end
compiles (the core has no tokenizer) and sends the compiled grammar, with
the vocabulary description once (`GrammarCompiler.vocab_json`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv import ops, reference
from pagedkv.errors import SamplingParamsError

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 16  # a schema, regex or grammar longer than this is refused (compiling is per request work)
MAX_CHOICES = 1024


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency: only structured requests need it
        raise SamplingParamsError("structured_outputs", "structured outputs need the xgrammar package "
                                                        "(pip install xgrammar)") from e
    return xgrammar


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint (vLLM's names): json (a JSON schema, dict or string), regex, choice (the output is one of
    these strings), grammar (EBNF / GBNF), or json_object (any JSON object). disable_any_whitespace: JSON with
    no whitespace between tokens of its syntax (small models otherwise may emit whitespace forever)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", f"structured_outputs takes exactly one of "
                                                            f"{CONSTRAINT_KINDS}, got {given or 'none'}")
        kind = given[0]
        if kind == "json":
            text = self.json if isinstance(self.json, str) else _dumps(self.json)
            if not isinstance(self.json, (str, dict)) or len(text) > MAX_SPEC_CHARS:
                raise SamplingParamsError("structured_outputs", f"json must be a JSON schema (a dict or its JSON "
                                                                f"text) of at most {MAX_SPEC_CHARS} characters")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS:
                raise SamplingParamsError("structured_outputs", f"{kind} must be a non-empty string of at most "
                                                                f"{MAX_SPEC_CHARS} characters")
        elif kind == "choice":
            ok = (isinstance(self.choice, list) and 0 < len(self.choice) <= MAX_CHOICES
                  and all(isinstance(c, str) and c for c in self.choice)
                  and sum(map(len, self.choice)) <= MAX_SPEC_CHARS)
            if not ok:
                raise SamplingParamsError("structured_outputs", f"choice must be 1 to {MAX_CHOICES} non-empty "
                                                                f"strings of at most {MAX_SPEC_CHARS} characters "
                                                                f"in all")
        elif self.json_object is not True:
            raise SamplingParamsError("structured_outputs", "json_object must be true when given")
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError("structured_outputs", "disable_any_whitespace must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) is not None)

    @classmethod
    def coerce(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        """The params from themselves or from a dict of their fields (as they cross the engine-core wire)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise SamplingParamsError("structured_outputs", f"structured_outputs must be StructuredOutputsParams "
                                                            f"or a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__slots__))
        if unknown:
            raise SamplingParamsError("structured_outputs", f"unknown structured_outputs fields {unknown}")
        return cls(**value)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (compiled grammars are cached by xgrammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int = 1) -> None:
        """vocab_size: the model's (its logits' width), which may exceed the tokenizer's: the extra ids are never
        allowed. Without a tokenizer (skip_tokenizer_init) structured outputs are refused."""
        if tokenizer is None:
            raise SamplingParamsError("structured_outputs", "structured outputs need a tokenizer "
                                                            "(skip_tokenizer_init=True)")
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; a constraint xgrammar cannot compile is refused naming structured_outputs."""
        c, kind = self.compiler, params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else _dumps(params.json)
                return c.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(_dumps(s) for s in params.choice))
            return c.compile_grammar(params.grammar)
        except SamplingParamsError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors on a bad spec
            raise SamplingParamsError("structured_outputs", f"the {kind} constraint could not be compiled: "
                                                            f"{str(e)[:500]}") from e

    def vocab_json(self) -> str:
        """The vocabulary description an engine core needs to load grammars compiled here (`load_grammar`)."""
        return self.info.serialize_json()


def load_vocab(vocab_json: str) -> Any:
    return _xgrammar().TokenizerInfo.deserialize_json(vocab_json)


def dump_grammar(compiled: Any) -> str:
    return compiled.serialize_json()


def load_grammar(grammar_json: str, vocab: Any) -> Any:
    return _xgrammar().CompiledGrammar.deserialize_json(grammar_json, vocab)


def new_matcher(compiled: Any, stop_token_ids: list[int]) -> Any:
    """A matcher at the grammar's start; once the grammar is complete it allows exactly the engine's EOS ids."""
    return _xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)


def apply_token_masks(logits: torch.Tensor, matchers: list[Any | None]) -> None:
    """In place: in each row with a matcher, every token its grammar forbids now gets -inf.

    The matchers fill one bit per vocabulary entry (int32 words [rows, ceil(vocab / 32)], in C++); float32
    logits on the CPU are masked by `ops.apply_token_bitmask` (0.2 ms for 48 rows of 49k, against 5-9 ms for
    torch's unpack and masked_fill), others by its PyTorch twin.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    words = torch.full((len(rows), math.ceil(logits.shape[1] / 32)), -1, dtype=torch.int32)
    needed = [matchers[i].fill_next_token_bitmask(words, j) for j, i in enumerate(rows)]
    if not any(needed):
        return
    index = torch.tensor(rows, dtype=torch.long)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        ops.apply_token_bitmask(logits, words, index)
    else:
        reference.apply_token_bitmask(logits, words, index)
