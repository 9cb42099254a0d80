"""Stop strings: the scheduler ends a request when one appears across token boundaries; the
detokenizer never lets any part of it reach the client."""

from hypothesis import given, strategies as st

from protocol import messages as m
from actors.detokenizer.stops import StopTrimmer
from actors.scheduler.core import Scheduler

VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "E", 7: "ND", 8: "x", 99: ""}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def run(tokens, **params):
    s = Scheduler(max_running=1, context_length=64, eos_ids=[99], decode=decode)
    s.add("r", [8], m.SamplingParams(max_new_tokens=20, **params))
    out_tokens, fin = [], None
    for tok in tokens:
        b = s.schedule()
        out = s.on_result(m.StepResult(step=b.step, rows=b.rows, tokens=[tok]))
        out_tokens += out.tokens.get("r", [])
        if out.finished:
            fin = out.finished[0]
            break
    return out_tokens, fin


def test_a_stop_string_split_across_tokens_ends_the_request():
    toks, fin = run([1, 2, 3, 6, 7, 5, 5], stop=["END"])
    assert toks == [1, 2, 3, 6, 7] and fin.reason == "stop" and fin.stop_str == "END"


def test_min_new_tokens_defers_stops():
    toks, fin = run([6, 7, 99, 5, 99], stop=["END"], min_new_tokens=3)
    assert toks == [6, 7, 99, 5, 99] and fin.reason == "stop" and fin.stop_str == ""


def test_trimmer_holds_a_possible_start_and_cuts_at_the_match():
    t = StopTrimmer(["END", "stop here"])
    assert t.push("Hello E") == "Hello "  # "E" may start "END"
    assert t.push("N") == ""
    assert t.push("Dx tail") == "" and t.done
    assert t.push("more") == "" and t.flush() == ""


def test_trimmer_releases_held_text_that_was_not_a_stop():
    t = StopTrimmer(["END"])
    assert t.push("the E") == "the "
    assert t.push("nd") == "End"
    assert t.push("EN") == ""
    assert t.flush() == "EN"


@given(st.text(alphabet="abEND ", max_size=40), st.lists(st.integers(1, 5), max_size=12))
def test_trimmed_stream_equals_the_text_before_the_first_stop(text, cuts):
    t, out, at = StopTrimmer(["END", "ab"]), "", 0
    for n in cuts:
        out += t.push(text[at:at + n])
        at += n
    out += t.push(text[at:]) + t.flush()
    firsts = [i for i in (text.find("END"), text.find("ab")) if i >= 0]
    assert out == (text[:min(firsts)] if firsts else text)
