"""Structured outputs (SamplingParams.structured_outputs) on the default model's real weights.

Every constrained output must follow its constraint whatever the model would
rather say: a JSON schema (validated with `jsonschema`), any JSON object, a
regex, a choice, an EBNF grammar; greedy and sampled, n > 1, beside
unconstrained requests (whose outputs must not change), and through
preemption (the grammar state lives on with the sequence). The token mask is
checked against a per-token reference; bad constraints are refused naming
the field.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from pagedkv import LLM, SamplingParams, StructuredOutputsParams
from pagedkv.sampling_params import SamplingParamsError
from pagedkv.structured_outputs import apply_token_masks

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Lima", "Oslo"]}},
          "required": ["name", "age", "city"]}
ASK = "Describe a person as JSON with their name, age and city: "


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=16)


def greedy(max_tokens: int = 48, **constraint) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint or None)


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_every_kind_of_constraint_is_followed(llm):
    grammar = 'root ::= "(" [1-9] [0-9]* " + " [1-9] [0-9]* ")"'
    outs = llm.generate(
        [ASK, ASK, "Say something: ", "Is the sky green? Answer: ", "My phone number is ", "Write a sum: "],
        [greedy(json=PERSON),
         SamplingParams(temperature=1.0, seed=5, max_tokens=48, n=3,
                        structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON),
                                                                   disable_any_whitespace=True)),
         greedy(json_object=True),
         greedy(choice=["yes", "no", "it depends"]),
         SamplingParams(temperature=0.8, seed=2, max_tokens=16, structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
         greedy(grammar=grammar)], use_tqdm=False)
    for c in outs[0].outputs + outs[1].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    # disable_any_whitespace: the canonical separators only, as xgrammar (and so vLLM) writes them.
    assert all(c.text == json.dumps(json.loads(c.text), ensure_ascii=False) for c in outs[1].outputs)
    assert isinstance(json.loads(outs[2].outputs[0].text), dict)
    assert outs[3].outputs[0].text in ("yes", "no", "it depends")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[4].outputs[0].text)
    assert re.fullmatch(r"\([1-9][0-9]* \+ [1-9][0-9]*\)", outs[5].outputs[0].text)
    # The end comes when the grammar is complete: the sequence stops on EOS, which is not text.
    assert all(o.outputs[0].token_ids[-1] in llm.llm_engine.eos_token_ids for o in outs)


def test_unconstrained_requests_beside_them_are_unchanged(llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    alone = texts(llm.generate(prompts, greedy(12), use_tqdm=False))
    mixed = llm.generate(prompts + [ASK, ASK], [greedy(12), greedy(12), greedy(json=PERSON),
                                               greedy(choice=["a", "b"])], use_tqdm=False)
    assert texts(mixed[:2]) == alone
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), PERSON)
    # Logprobs stay those of the model's own distribution: the grammar's mask does not change them.
    both = llm.generate([ASK, ASK], [SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                                     SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                                                    structured_outputs={"regex": "[0-9]+"})], use_tqdm=False)
    free, bound = (o.outputs[0] for o in both)
    top = {t: round(v.logprob, 4) for t, v in free.logprobs[0].items() if v.rank <= 5}
    assert {t: round(v.logprob, 4) for t, v in bound.logprobs[0].items() if v.rank <= 5} == top
    assert bound.text.isdigit() and not free.text.isdigit()


def test_grammar_state_survives_preemption(loaded_model):
    """A cache of 12 blocks of 16 for 6 sequences of ~30 + ~18 tokens: they are preempted and recomputed; each
    output is still the one a roomy cache gives, and still valid."""
    prompts = [ASK + f"Keep every value short, and write nothing else. (person number {i})" for i in range(6)]
    params = greedy(48, json=PERSON)
    per_token = loaded_model.model.config.kv_bytes_per_token(torch.float32, 1)
    roomy = LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=128, max_num_seqs=8)
    want = texts(roomy.generate(prompts, params, use_tqdm=False))
    tight = LLM(loaded_model=loaded_model, kv_cache_memory=per_token * 16 * 12, max_model_len=128, max_num_seqs=8,
                block_size=16)
    got = texts(tight.generate(prompts, params, use_tqdm=False))
    assert tight.get_stats().num_preemptions > 0
    assert got == want
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("constraint, match", [
    ({"json": {"type": "no-such-type"}}, "could not be compiled"),
    ({"regex": "(unclosed"}, "could not be compiled"),
    ({"grammar": "root ::= undefined_rule"}, "could not be compiled"),
])
def test_constraints_that_do_not_compile_are_refused(llm, constraint, match):
    with pytest.raises(SamplingParamsError, match=match) as e:
        llm.llm_engine.add_request("bad", "hi", greedy(**constraint))
    assert e.value.param == "structured_outputs" and "bad" not in llm.llm_engine.requests
    refused = llm.generate("hi", greedy(**constraint), use_tqdm=False)[0]
    assert refused.outputs[0].finish_reason == "abort" and match in refused.error


@pytest.mark.parametrize("fields, param", [
    ({}, "structured_outputs"),
    ({"json": PERSON, "regex": "a"}, "structured_outputs"),
    ({"choice": []}, "structured_outputs"),
    ({"choice": ["a", 3]}, "structured_outputs"),
    ({"json_object": False}, "structured_outputs"),
    ({"regex": "x" * 70000}, "structured_outputs"),
    ({"json": PERSON, "no_such_field": 1}, "structured_outputs"),
    ({"json": PERSON, "disable_any_whitespace": "yes"}, "structured_outputs"),
])
def test_malformed_constraints_are_refused(fields, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(structured_outputs=fields)
    assert e.value.param == param


def test_min_tokens_cannot_be_combined():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(min_tokens=2, structured_outputs={"json_object": True})
    assert e.value.param == "min_tokens"


class _FixedMask:
    """A matcher stand-in that allows a fixed set of tokens (the real ones fill the same int32 words)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_next_token_bitmask(self, words: torch.Tensor, row: int) -> bool:
        words[row] = 0
        for t in self.allowed:
            word, bit = divmod(t, 32)
            words[row, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)  # bit 31 wraps negative
        return True


def test_token_masks_match_a_per_token_reference():
    torch.manual_seed(0)
    vocab = 1003  # not a multiple of 32
    logits = torch.randn(5, vocab)
    allowed = {0: [0, 31, 32, 1002], 2: [5], 3: list(range(0, vocab, 7))}
    matchers = [_FixedMask(allowed[i]) if i in allowed else None for i in range(5)]
    got = logits.clone()
    apply_token_masks(got, matchers)
    want = logits.clone()
    for row, ids in allowed.items():
        keep = torch.full((vocab,), float("-inf"))
        keep[ids] = logits[row, ids]
        want[row] = keep
    assert torch.equal(got, want)
