"""The front end's text path without a model: incremental detokenization, stop strings across token seams,
the DELTA holdback, the text of a finished output, and OutputProcessor turning the core's deltas into
RequestOutputs. The default model's tokenizer; no weights are loaded."""

from __future__ import annotations

import pytest
from pagedkv.core.sequence import OutputKind
from pagedkv.engine.core_messages import RequestDelta, SampleDelta, WireLogprob, metrics_to_wire, pack_ids
from pagedkv.engine.detokenizer import _delta_text, final_text, find_stop_string, needs_text, update_text
from pagedkv.engine.output_processor import OutputProcessor, RequestState, SampleState
from pagedkv.outputs import RequestMetrics
from pagedkv.sampling_params import SamplingParams
from transformers import AutoTokenizer

FLAMINGO = "\U0001F9A9"  # one emoji the default model's tokenizer writes as three byte tokens
EOS = 2


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def flamingo(tok) -> list[int]:
    """FLAMINGO's token ids: the first two alone decode to U+FFFD (an incomplete character)."""
    ids = tok.encode(FLAMINGO)
    assert len(ids) == 3 and tok.decode(ids[:2]).endswith("\ufffd") and tok.decode(ids) == FLAMINGO
    return ids


def feed(tok, sample: SampleState, ids: list[int]) -> list[str]:
    """Appends ids one at a time as the front end does; the new text after each."""
    news = []
    for token in ids:
        sample.output_token_ids.append(token)
        news.append(update_text(tok, sample))
    return news


# --- incremental detokenization ----------------------------------------------------------------------------

def test_incremental_text_equals_one_decode_and_waits_for_whole_characters(tok, flamingo):
    text = "Café \U0001F642 naïve x中文y, end.\n\nUser:"
    ids = tok.encode(text) + flamingo + tok.encode(" done")
    sample = SampleState(0)
    news = feed(tok, sample, ids)
    assert sample.text == tok.decode(ids) == "".join(news)
    assert not any("\ufffd" in n for n in news)
    # The flamingo's first two byte tokens add nothing; its third adds the whole character.
    at = len(tok.encode(text))
    assert news[at:at + 3] == ["", "", FLAMINGO]


def test_an_incomplete_character_leaves_the_offsets_where_they_were(tok, flamingo):
    sample = SampleState(0, output_token_ids=tok.encode("ab"))
    update_text(tok, sample)
    offsets = (sample.prefix_offset, sample.read_offset)
    feed(tok, sample, flamingo[:2])
    assert (sample.prefix_offset, sample.read_offset) == offsets and sample.text == "ab"
    assert feed(tok, sample, flamingo[2:]) == [FLAMINGO]
    assert sample.read_offset == len(sample.output_token_ids)


def test_special_tokens_are_skipped_or_kept_on_request(tok):
    kept, skipped = SampleState(0), SampleState(1)
    for token in tok.encode("Hi") + [EOS]:
        for s in (kept, skipped):
            s.output_token_ids.append(token)
        update_text(tok, kept, skip_special_tokens=False)
        update_text(tok, skipped)  # skipped by default
    assert skipped.text == "Hi"
    assert kept.text == "Hi" + tok.decode([EOS])


# --- stop strings --------------------------------------------------------------------------------------------

def stop_in(text_before: str, new: str, stops: list[str], include: bool = False) -> tuple[str | None, str]:
    sample = SampleState(0, text=text_before + new)
    found = find_stop_string(sample, len(new), stops, include)
    return found, sample.text


def test_a_stop_string_across_the_seam_is_found_and_cut():
    assert stop_in("ab", "c", ["bc"]) == ("bc", "a")
    assert stop_in("ab", "c", ["bc"], include=True) == ("bc", "abc")
    assert stop_in("xabc", "d", ["abcd"]) == ("abcd", "x")  # starts at the earliest place new text can complete it


def test_a_stop_string_wholly_before_the_new_text_is_not_searched_for_again():
    # Text already checked when it arrived: only a stop the new text completes counts.
    assert stop_in("a stop", "!", ["stop"]) == (None, "a stop!")  # it ends just before the new text
    assert stop_in("ab", "", ["ab"]) == (None, "ab")


def test_the_first_stop_string_listed_wins_and_the_cut_is_at_its_start():
    assert stop_in("", "one two", ["two", "one"]) == ("two", "one ")
    assert stop_in("", "one two", ["one", "two"], include=True) == ("one", "one")


def test_no_stop_strings_means_no_search():
    assert stop_in("", "anything", []) == (None, "anything")


# --- DELTA text and the finished output's text -------------------------------------------------------------------

def test_delta_text_keeps_back_a_possible_stop_string_until_finished():
    sample = SampleState(0, text="abcdef")
    assert _delta_text(sample, holdback=2) == "abcd"
    sample.text += "g"
    assert _delta_text(sample, holdback=2) == "e"
    sample.text += "h"
    sample.finish_reason = "length"
    assert _delta_text(sample, holdback=2) == "fgh"
    assert _delta_text(sample, holdback=2) == ""


def test_delta_text_never_takes_back_what_it_sent():
    sample = SampleState(0, text="abcdef")
    assert _delta_text(sample, holdback=0) == "abcdef"
    sample.text += "x"  # a longer holdback later cannot move the emitted mark back
    assert _delta_text(sample, holdback=5) == ""
    assert sample.num_emitted_chars == 6


def test_final_text_drops_the_token_that_stopped_the_sample(tok):
    ids = tok.encode("Hello world")
    plain = SamplingParams(max_tokens=8)
    assert final_text(tok, ids + [EOS], plain, "stop", None) == "Hello world"
    period = tok.encode(".")[0]  # a stop token id
    assert final_text(tok, ids + [period], plain, "stop", period) == "Hello world"
    assert final_text(tok, ids, plain, "length", None) == "Hello world"
    # ignore_eos: a "stop" without a stop id is a stop string's, so the last token is text.
    ignoring = SamplingParams(max_tokens=8, ignore_eos=True)
    assert final_text(tok, ids, ignoring, "stop", None) == "Hello world"
    assert final_text(tok, ids, ignoring, "stop", ids[-1]) == "Hello"


def test_needs_text_only_for_stop_strings_or_outputs_before_the_end():
    assert not needs_text(SamplingParams(), OutputKind.FINAL_ONLY)
    assert needs_text(SamplingParams(stop=["x"]), OutputKind.FINAL_ONLY)
    assert needs_text(SamplingParams(), OutputKind.DELTA)
    assert needs_text(SamplingParams(), OutputKind.CUMULATIVE)


# --- OutputProcessor ------------------------------------------------------------------------------------------

def request(rid: str, params: SamplingParams, kind: OutputKind = OutputKind.CUMULATIVE) -> RequestState:
    return RequestState(rid, "prompt", [5, 6], params, kind, RequestMetrics(arrival_time=1.0))


def delta(rid: str, samples: list[SampleDelta], finished: bool = False, cached: int = 0,
          error: str | None = None) -> RequestDelta:
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=2.0, num_cached_tokens=cached)
    return RequestDelta(rid, samples, finished, metrics_to_wire(metrics), error)


def sample(index: int, ids: list[int], finish: str | None = None, stop_reason=None, logprobs=None) -> SampleDelta:
    return SampleDelta(index, pack_ids(ids), logprobs, finish, stop_reason)


def test_a_stop_string_split_over_two_tokens_ends_the_sample_and_tells_the_core(tok):
    ids = tok.encode(" end.\n\nUser: more")  # " end", ".", "\n", "\n", "User", ":", " more"
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(max_tokens=16, stop=["\n\nUser"]), OutputKind.DELTA))
    outs, stopped = proc.process([delta("r", [sample(0, ids[:3])])])
    # " end.\n": the last 5 characters (the stop string's length - 1) are held back, they may start it.
    assert stopped == [] and outs[0].outputs[0].text == " " and outs[0].outputs[0].token_ids == ids[:3]
    outs, stopped = proc.process([delta("r", [sample(0, ids[3:])])])
    assert stopped == [("r", 0)]
    out = outs[0]
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "\n\nUser"
    assert out.outputs[0].text == "end."  # the rest before the stop string; it and what followed are cut
    assert out.outputs[0].token_ids == ids[3:5]  # the tokens after the stop string's are dropped
    assert "r" not in proc.requests
    # The core's late news of that request is ignored.
    assert proc.process([delta("r", [sample(0, [7])])]) == ([], [])


def test_cumulative_outputs_carry_the_whole_text_and_a_core_stop_adds_none(tok):
    ids = tok.encode("Hello world")
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(max_tokens=16)))
    outs, _ = proc.process([delta("r", [sample(0, ids[:1])])])
    assert outs[0].outputs[0].text == tok.decode(ids[:1]) and not outs[0].finished
    outs, stopped = proc.process([delta("r", [sample(0, ids[1:] + [EOS], "stop")], finished=True, cached=16)])
    out = outs[0]
    assert stopped == [] and out.finished and out.num_cached_tokens == 16
    assert out.outputs[0].text == "Hello world" and out.outputs[0].token_ids == ids + [EOS]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None  # none were asked for


def test_final_only_reports_once_with_the_text_decoded_at_the_end(tok):
    ids = tok.encode("one two three")
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(max_tokens=3), OutputKind.FINAL_ONLY))
    assert proc.process([delta("r", [sample(0, ids[:1])])]) == ([], [])
    assert proc.requests["r"].samples[0].text == ""  # no text is made while it runs
    outs, _ = proc.process([delta("r", [sample(0, ids[1:], "length")], finished=True)])
    assert len(outs) == 1 and outs[0].outputs[0].text == "one two three"
    assert outs[0].outputs[0].finish_reason == "length"


def test_n_samples_finish_on_their_own(tok):
    a, b = tok.encode(" yes"), tok.encode(" no")
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1)))
    outs, _ = proc.process([delta("r", [sample(0, a + [EOS], "stop"), sample(1, b[:1])])])
    assert not outs[0].finished and [c.finish_reason for c in outs[0].outputs] == ["stop", None]
    outs, _ = proc.process([delta("r", [sample(1, b[1:], "length")])])
    assert outs[0].finished and [c.text for c in outs[0].outputs] == [" yes", " no"]
    assert [c.finish_reason for c in outs[0].outputs] == ["stop", "length"]


def test_a_finished_requests_late_news_does_not_hide_the_others(tok):
    proc = OutputProcessor(tok)
    proc.add(request("live", SamplingParams(max_tokens=4)))
    outs, _ = proc.process([delta("gone", [sample(0, [7])]), delta("live", [sample(0, tok.encode("Hi"))])])
    assert [o.request_id for o in outs] == ["live"] and outs[0].outputs[0].text == "Hi"


def test_logprobs_build_up_with_their_cumulative_sum(tok):
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(max_tokens=2, logprobs=1)))
    wire = [[WireLogprob(7, -0.5, 1), WireLogprob(8, -1.0, 2)], [WireLogprob(9, -0.25, 1)]]
    outs, _ = proc.process([delta("r", [sample(0, [7, 9], "length", logprobs=wire)], finished=True)])
    c = outs[0].outputs[0]
    assert c.cumulative_logprob == pytest.approx(-0.75)
    assert [sorted(e) for e in c.logprobs] == [[7, 8], [9]] and c.logprobs[0][8].rank == 2


def test_an_error_fails_every_sample_of_the_request(tok):
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(n=2, max_tokens=4, temperature=1.0)))
    outs, _ = proc.process([delta("r", [], finished=True, error="engine failed")])
    out = outs[0]
    assert out.finished and out.error == "engine failed" and "r" not in proc.requests
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "error"), (1, "error")]
    assert out.metrics.finished_time is not None


def test_a_finish_with_no_new_tokens_still_finishes_the_sample(tok):
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(max_tokens=4), OutputKind.DELTA))
    proc.process([delta("r", [sample(0, tok.encode("Hi"))])])
    outs, _ = proc.process([delta("r", [sample(0, [], "abort")], finished=True)])
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert outs[0].outputs[0].token_ids == []


def test_a_stop_string_on_the_cores_last_token_wins_over_its_length_finish(tok):
    ids = tok.encode(" end.\n\nUser")
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(max_tokens=len(ids), stop=["\n\nUser"])))
    outs, stopped = proc.process([delta("r", [sample(0, ids, "length")], finished=True)])
    c = outs[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", "\n\nUser", " end.")
    assert stopped == []  # the core ended it already: nothing to tell it


def test_a_sample_ended_here_skips_its_late_tokens_not_its_siblings(tok):
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(n=2, max_tokens=8, temperature=1.0, stop=["!"])))
    outs, stopped = proc.process([delta("r", [sample(0, tok.encode("Hi!"))])])
    assert stopped == [("r", 0)]
    outs, _ = proc.process([delta("r", [sample(0, tok.encode(" more")), sample(1, tok.encode(" Yo"))])])
    assert [c.text for c in outs[0].outputs] == ["Hi", " Yo"]


def test_streamed_text_never_ends_in_half_a_character(tok, flamingo):
    """max_tokens cuts the emoji after two of its three byte tokens: neither the deltas nor the final text
    carry the incomplete character."""
    ids = tok.encode("ab") + flamingo[:2]
    proc = OutputProcessor(tok)
    proc.add(request("r", SamplingParams(max_tokens=len(ids)), OutputKind.DELTA))
    outs, _ = proc.process([delta("r", [sample(0, ids[:-1])])])
    streamed = outs[0].outputs[0].text
    outs, _ = proc.process([delta("r", [sample(0, ids[-1:], "length")], finished=True)])
    streamed += outs[0].outputs[0].text
    assert outs[0].finished and streamed == "ab"
