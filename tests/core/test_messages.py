"""Every wire message round-trips through the real codec and the decoder of its inbox."""

import msgspec
import pytest

from protocol import messages as m
from protocol.codec import decoder, encode, pack_ids, split_counts, unpack_ids

SP = m.SamplingParams(max_new_tokens=7, temperature=0.5, stop_token_ids=[3], ignore_eos=True)
FIN = m.Finish(rid="r1", reason="stop", prompt_tokens=3, completion_tokens=2, cached_tokens=1)

SAMPLES = {
    m.GenerateRequest: m.GenerateRequest(req_id="a", prompt="hé 中文 🙂", max_new_tokens=5,
                                         temperature=0.7, stream=True, stop_token_ids=[1, 2],
                                         ignore_eos=True),
    m.AbortRequest: m.AbortRequest(req_id="a"),
    m.Delta: m.Delta(req_id="a", text="中", token_ids=[1, 2]),
    m.Finished: m.Finished(req_id="a", text="x", token_ids=[5], finish_reason="length",
                           prompt_tokens=3, completion_tokens=1, cached_tokens=0, ttft_s=0.5,
                           total_s=1.0),
    m.ErrorReply: m.ErrorReply(req_id="a", message="bad", code=503),
    m.TokenizedRequest: m.TokenizedRequest(rid="r1", input_ids=pack_ids([1, 2, 151643]),
                                           params=SP),
    m.Abort: m.Abort(rid="r1"),
    m.Shutdown: m.Shutdown(reason="sigterm", drain=True),
    m.ForwardBatch: m.ForwardBatch(step=4, rows=[1, 2], input_lens=[1, 3], start_pos=[9, 0],
                                   future=[True, False], sample=[True, True],
                                   input_ids=pack_ids([7, 8, 9]), admit_rows=[2],
                                   admit_params=[SP]),
    m.StepResult: m.StepResult(step=4, rows=[1, 2], tokens=[11, 12], forward_s=0.01),
    m.TokenBatch: m.TokenBatch(rids=["r1", "r2"], counts=[1, 0], token_ids=pack_ids([5]),
                               finished=[FIN]),
    m.TextBatch: m.TextBatch(rids=["r1"], texts=["é"], counts=[1], token_ids=pack_ids([5]),
                             finished=[FIN]),
    m.Ready: m.Ready(actor="tokenizer", pid=1, info={"client": "tcp://127.0.0.1:1"}),
    m.ActorFailed: m.ActorFailed(actor="runner", message="boom"),
    m.ModelLayers: m.ModelLayers(kinds=["sliding", "full", "other:CacheList"]),
}

INBOXES = {
    "client_in": m.ClientInbound, "client_out": m.ClientOutbound,
    "tokenizer": m.TokenizerInbox, "scheduler": m.SchedulerInbox, "runner": m.RunnerInbox,
    "detokenizer": m.DetokenizerInbox, "launcher": m.LauncherInbox,
}


def _all_message_types():
    found = set()
    for base in (m.Wire, m.ClientWire):
        stack = [base]
        while stack:
            for sub in stack.pop().__subclasses__():
                found.add(sub)
                stack.append(sub)
    return found


def test_every_message_has_a_sample_and_a_unique_tag():
    types = _all_message_types()
    assert types == set(SAMPLES), types ^ set(SAMPLES)
    tags = [t.__struct_config__.tag for t in types]
    assert len(tags) == len(set(tags))
    assert sorted(tags) == sorted(m.TAGS.values())


@pytest.mark.parametrize("union_name", sorted(INBOXES))
def test_round_trip_through_each_inbox_decoder(union_name):
    union = INBOXES[union_name]
    dec = decoder(union)
    members = union.__args__
    for cls in members:
        msg = SAMPLES[cls]
        assert dec.decode(encode(msg)) == msg


def test_inbox_decoder_rejects_messages_of_other_inboxes():
    with pytest.raises(msgspec.ValidationError):
        decoder(m.RunnerInbox).decode(encode(SAMPLES[m.TokenBatch]))


def test_golden_bytes_pin_the_wire_format():
    # Field order is the wire format: appending fields with defaults keeps these decodable.
    assert encode(m.Abort(rid="r")) == b"\x92\x0b\xa1r"
    before_head_input = b"\x92\x13\x91\xa4full"
    assert encode(m.ModelLayers(kinds=["full"])) == b"\x93" + before_head_input[1:] + b"\xc2"
    assert decoder(m.SchedulerInbox).decode(before_head_input) == m.ModelLayers(kinds=["full"])
    before_logprobs = b"\x96\x0d\x01\x91\x02\x91\x03\xcb" + bytes(8) + b"\xa0"
    assert encode(m.StepResult(step=1, rows=[2], tokens=[3])) == \
        b"\x9a" + before_logprobs[1:] + b"\x90\x90\x90\x90"
    # A message from a sender that predates the appended fields still decodes.
    old = decoder(m.SchedulerInbox).decode(before_logprobs)
    assert old == m.StepResult(step=1, rows=[2], tokens=[3]) and old.logprobs == []


def test_token_packing_is_int32():
    ids = [0, 1, 151643, 2**31 - 1]
    assert len(pack_ids(ids)) == 16
    assert unpack_ids(pack_ids(ids)) == ids
    assert split_counts([1, 2, 3, 4], [1, 0, 3]) == [[1], [], [2, 3, 4]]
