"""Stop strings: the scheduler ends a request when one appears across token boundaries; the
detokenizer never lets any part of it reach the client."""

from hypothesis import given, strategies as st

from protocol import messages as m
from actors.detokenizer.actor import convert
from actors.detokenizer.core import Detokenizer
from actors.detokenizer.stops import StopTrimmer
from protocol.codec import pack_ids
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
    last = t.push("Dx tail")  # the scheduler ends the request at this token: stop_str "END"
    assert t.end(last, " more", "END") == ""


def test_trimmer_releases_held_text_that_was_not_a_stop():
    t = StopTrimmer(["END"])
    assert t.push("the E") == "the "
    assert t.push("nd") == "End"
    assert t.push("EN") == ""
    assert t.end("", "", "") == "EN"  # ended without a stop string: held text is text


@given(st.text(alphabet="abEND ", max_size=40), st.lists(st.integers(1, 5), max_size=12))
def test_trimmed_stream_equals_the_text_before_the_first_stop(text, cuts):
    # Plays the scheduler: the request ends with the piece in which the first stop string
    # completes ("END" and "ab" share no letter, so the first to start is the first to end).
    stops = ["END", "ab"]
    found = [(text.find(s), s) for s in stops if s in text]
    first = min(found) if found else None
    t, out, at = StopTrimmer(stops), "", 0
    for n in [*cuts, len(text)]:
        piece = text[at:at + n]
        at += n
        pushed = t.push(piece)
        if first is not None and first[0] + len(first[1]) <= at:
            out += t.end(pushed, "", first[1])
            break
        out += pushed
    else:
        out += t.end("", "", "")
    assert out == (text[:first[0]] if first else text)


def test_a_stop_string_before_min_new_tokens_does_not_cut_the_text():
    # "END" completes at the 2nd token, before min_new_tokens = 3: the scheduler goes on, and
    # so does the text; the request ends by length with no stop_str.
    core, stops = Detokenizer(decode), {}
    ids = [6, 7, 5, 3, 4]
    text = ""
    for k, tok in enumerate(ids):
        last = k == len(ids) - 1
        batch = m.TokenBatch(rids=["r"], counts=[1], token_ids=pack_ids([tok]),
                             stops={"r": ["END"]} if k == 0 else {},
                             finished=[m.Finish(rid="r", reason="length", prompt_tokens=1,
                                                completion_tokens=5)] if last else [])
        text += "".join(convert(core, stops, batch).texts)
    assert text == "END! world" and not stops
