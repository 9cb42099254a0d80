"""Every struct that crosses a socket, and one tagged union per inbox.

Field order is the wire format (array_like): append new fields at the end, with defaults.
Tags are small integers listed once, in TAGS below, so two messages can never share one.
Hot per-step messages (ForwardBatch, StepResult, TokenBatch, TextBatch) are columnar: one list
per field, token ids as int32 bytes.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

# One table for every tag on every socket: a message's tag never changes once shipped.
TAGS = {
    # client <-> tokenizer (ROUTER)
    "GenerateRequest": 1,
    "AbortRequest": 2,
    "Delta": 3,
    "Finished": 4,
    "ErrorReply": 5,
    # inside the graph
    "TokenizedRequest": 10,
    "Abort": 11,
    "ForwardBatch": 12,
    "StepResult": 13,
    "TokenBatch": 14,
    "TextBatch": 15,
    "Shutdown": 16,
    "Ready": 17,
    "ActorFailed": 18,
    "ModelLayers": 19,
}


class Wire(msgspec.Struct, frozen=True, array_like=True, gc=False, tag_field="t"):
    """Base of every wire message. Subclasses set their tag from TAGS."""


def _tag(cls_name: str) -> int:
    return TAGS[cls_name]


class Plain(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A nested value inside a message: no tag of its own."""


class ClientWire(msgspec.Struct, frozen=True, gc=False, tag_field="type",
                 forbid_unknown_fields=True):
    """Base of the client API: encoded as maps, so a bad field is named in the error reply and
    a client in any language can build requests by hand."""


# ---------------------------------------------------------------------------------------------
# Client API (a DEALER client talks to the tokenizer's ROUTER socket)


# Numbers a request carries must fit the wire inside the graph (msgpack int64, finite floats):
# every int field has an upper bound, every float field a finite range.
INT64_MAX = 2**63 - 1
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]  # int32 on the wire; the vocabulary checks later


class ChatMessage(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    role: str
    content: str
    # An assistant turn's tool calls ([{"id", "type": "function", "function": {"name",
    # "arguments"}}], as OpenAI writes them), and a tool turn's answer to one: passed to the
    # chat template as they are.
    tool_calls: list[dict[str, Any]] = []
    tool_call_id: str = ""
    name: str = ""
    # An assistant turn's reasoning sent back (Qwen3's templates show it within a tool loop).
    reasoning_content: str = ""


class GenerateRequest(ClientWire, tag=_tag("GenerateRequest")):
    """A client asks for a completion. `req_id` is the client's own id for the request; replies
    carry it back. Exactly one of prompt / input_ids / messages is given."""

    req_id: str
    prompt: str = ""
    input_ids: list[TokenId] = []
    messages: list[ChatMessage] = []
    max_new_tokens: Annotated[int, Meta(ge=1, le=INT64_MAX)] = 128
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    stream: bool = False
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Count = 0  # 0: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] = 1.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]] = {}
    seed: Count | None = None
    stop: list[str] = []  # stop strings: matched across token boundaries, trimmed from the text
    min_new_tokens: Count = 0
    logprobs: bool = False  # the chosen tokens' logprobs
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0  # and this many alternatives each
    # Prompt logprobs (sglang's logprob_start_len): every prompt position from this one on
    # gets its token's logprob given the tokens before it, and top_logprobs alternatives
    # (position 0 has none: nothing comes before it). -1: none.
    logprob_start_len: Annotated[int, Meta(ge=-1, le=INT64_MAX)] = -1
    echo: bool = False  # the first reply carries the prompt's token ids and text
    # Requests of one group share one prompt (n choices): its prefill runs once, the others
    # wait for it and reuse it through the prefix cache.
    group: str = ""
    chat_template_kwargs: dict[str, Any] = {}  # passed to the chat template (with messages)
    api_key: str = ""  # server.api_key, when the server has one (ZMQ; HTTP sends a header)
    # Constrained output, at most one of them (sglang's names): a JSON schema (as JSON text;
    # '{"type": "object"}' for any JSON object), a regular expression, or a Lark grammar (EBNF
    # as llguidance reads it). The output then always matches, unless cut by max_new_tokens.
    json_schema: str = ""
    regex: str = ""
    ebnf: str = ""
    # Free text in which each trigger starts a structure whose body follows its schema:
    # {"structures": [{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]} as JSON.
    structural_tag: str = ""
    # Functions the model may call ([{"type": "function", "function": {"name", "description",
    # "parameters"}}]), shown to it by the chat template (with messages).
    tools: list[dict[str, Any]] = []
    # A conversation's id (an agent's session): with scheduler.dp > 1 its requests stay on one
    # replica, whose prefix cache holds the turns before.
    session: str = ""


class AbortRequest(ClientWire, tag=_tag("AbortRequest")):
    req_id: str


class Delta(ClientWire, tag=_tag("Delta")):
    """A streamed piece of a reply: new text and the token ids that produced it."""

    req_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] = []  # per token id, when asked
    top_ids: list[list[int]] = []  # per token id: the best alternatives, when asked
    top_logprobs: list[list[float]] = []
    # The prompt, in the request's first Delta (streamed) or its Finished, when it asked for
    # echo or prompt logprobs: its ids, its text (echo), and per position its token's logprob
    # (None where not scored) and the top alternatives ([] where not scored).
    prompt_ids: list[int] = []
    prompt_text: str = ""
    prompt_logprobs: list[float | None] = []
    prompt_top_ids: list[list[int]] = []
    prompt_top_logprobs: list[list[float]] = []


class Finished(ClientWire, tag=_tag("Finished")):
    """The one terminal reply of a request that ran: stop, length or abort."""

    req_id: str
    text: str  # the whole text when not streamed; "" when streamed (the client joins the pieces)
    token_ids: list[int]  # every generated token id
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    logprobs: list[float] = []  # per generated token, when asked (all of them, even streamed)
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    stop_str: str = ""  # the stop string that ended it, if one did
    # The prompt, in the request's first Delta (streamed) or its Finished, when it asked for
    # echo or prompt logprobs: its ids, its text (echo), and per position its token's logprob
    # (None where not scored) and the top alternatives ([] where not scored).
    prompt_ids: list[int] = []
    prompt_text: str = ""
    prompt_logprobs: list[float | None] = []
    prompt_top_ids: list[list[int]] = []
    prompt_top_logprobs: list[list[float]] = []


class ErrorReply(ClientWire, tag=_tag("ErrorReply")):
    """The one terminal reply of a request that failed; `code` follows HTTP (400, 503, 500)."""

    req_id: str
    message: str
    code: int = 400


ClientInbound = Union[GenerateRequest, AbortRequest]
ClientOutbound = Union[Delta, Finished, ErrorReply]


# ---------------------------------------------------------------------------------------------
# Inside the graph


class SamplingParams(Plain):
    max_new_tokens: int
    temperature: float = 0.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    bias_ids: list[int] = []
    bias_values: list[float] = []
    seed: int = -1  # -1: not seeded
    min_new_tokens: int = 0
    stop: list[str] = []
    logprobs: bool = False
    top_logprobs: int = 0
    # A constraint on the output: its kind ("" none; actors/constraints.py KINDS) and the
    # llguidance grammar the tokenizer compiled it to (the runner builds matchers from it).
    constraint_kind: str = ""
    constraint: str = ""
    prompt_logprobs_from: int = -1  # GenerateRequest.logprob_start_len


class PromptScores(Plain):
    """Logprobs of prompt tokens at consecutive positions from `start`: each the raw
    log_softmax of the logits before it at that token, and the top alternatives."""

    start: int
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []


class TokenizedRequest(Wire, tag=_tag("TokenizedRequest")):
    rid: str
    input_ids: bytes  # int32, native byte order
    params: SamplingParams
    group: str = ""


class Abort(Wire, tag=_tag("Abort")):
    rid: str


class Shutdown(Wire, tag=_tag("Shutdown")):
    """The launcher tells an actor to stop. `drain`: finish open work up to the deadline first."""

    reason: str
    drain: bool = False


class OpKind(IntEnum):
    """Deferred memory ops, decided by the scheduler (actors/scheduler/ops.py), applied by the
    runner (actors/model_runner/storage.py) at the start of the forward they ride with, in list
    order (docs/architecture.md, section 6). The value is the wire format: never renumber."""

    CLEAR = 0  # state slot `dst` starts from zeros (a request with no usable prefix)
    COPY = 1  # state `src` -> `dst`: a prefix hit copies the node's snapshot (the node keeps it)
    SNAPSHOT = 2  # live state `src` -> node slot `dst`, at a chunk boundary
    # 3 and 4 were KV_SAVE and KV_LOAD, from when the prefix cache kept KV in a pool of its
    # own: never reuse them.
    # Row `dst` gives its live state slot `src` to the tree as the node's snapshot, no copy:
    # the runner stops writing the row's state through to it.
    DONATE = 5
    # Row `dst`'s page table from index `start` on is the pages in `slots` (the table is cut
    # at `start` first): admission sends a row's whole table (start 0), growth its new pages.
    PAGES = 6
    # KV of the one pool: slot `slots[i]` -> slot `slots[n + i]` for the first n = len / 2
    # (a prefix hit's partial last page, copied into the request's own page).
    KV_COPY = 7


# Tokens per page of the one KV pool (docs/architecture.md, section 8): slot id s is token
# s % KV_PAGE of page s // KV_PAGE. The scheduler hands out pages; page 0 is the runner's
# scratch page (padding rows write there) and never handed out.
KV_PAGE = 16


class Op(Plain):
    kind: OpKind
    src: int = 0
    dst: int = 0
    start: int = 0
    slots: bytes = b""  # int32 ids: page ids (PAGES), KV slot ids (KV_COPY)
    # SNAPSHOT / DONATE of a row whose last forward sampled: the state slot also keeps the LM
    # head's input at that position, so an exact repeat samples from it with no forward.
    head_input: bool = False


class ForwardBatch(Wire, tag=_tag("ForwardBatch")):
    """One step for the runner. Per row (columnar): the request-pool row, how many new input
    tokens it brings, the position of the first one, whether its input is a future (the token
    this row sampled last, held by the runner) and whether to sample a token after it."""

    step: int
    rows: list[int]
    input_lens: list[int]
    start_pos: list[int]
    future: list[bool]
    sample: list[bool]
    input_ids: bytes  # int32: the non-future rows' inputs, concatenated in row order
    # Sampling parameters travel once, when a row is admitted; later steps refer to the row.
    admit_rows: list[int] = []
    admit_params: list[SamplingParams] = []
    # Rows the scheduler released since the last step (no step in flight references them):
    # the runner drops whatever it holds for them before running this step.
    release_rows: list[int] = []
    ops: list[Op] = []
    admit_states: list[int] = []  # hybrid models: each admitted row's live state slot
    # Per admitted row: how many of its tokens are output already (a retracted request
    # resumes), and, when its penalties need them, every token so far (int32: prompt + output).
    admit_generated: list[int] = []
    admit_tokens: list[bytes] = []
    # The scheduler built the next step already (overlap): the runner may wait a moment for
    # it before reading this one back. False: nothing follows until this step's result is in,
    # so the runner reads it back at once.
    follows: bool = True
    # Prompt chunks whose positions are scored (prompt logprobs), one entry each: the row, the
    # first position whose token is scored, and the prompt token after the chunk (-1: the
    # chunk ends the prompt, its last logits are the sample's).
    score_rows: list[int] = []
    score_start: list[int] = []
    score_next: list[int] = []
    # scheduler.prefill_first: the decoding rows sit this step out (none is in it) and the
    # runner runs no decode forward; their caches and last tokens stay as they are.
    hold_decode: bool = False


class StepResult(Wire, tag=_tag("StepResult")):
    """What the runner sampled: one token per sampled row of the step, in the step's row order."""

    step: int
    rows: list[int]
    tokens: list[int]
    forward_s: float = 0.0  # wall time the runner spent on this step
    error: str = ""  # non-empty: the step failed on the runner, nothing was sampled
    # Per sampled row, when any row of the step asked for them (else empty):
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    scores: list[PromptScores] = []  # per ForwardBatch.score_rows entry


class Finish(Plain):
    """How one request ended, riding along the last TokenBatch/TextBatch that mentions it."""

    rid: str
    reason: str  # stop | length | abort | error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    message: str = ""  # for reason == "error"
    code: int = 500  # for reason == "error": 400 the request was bad, 500 the server failed
    stop_str: str = ""  # reason == "stop" by a stop string: which one


class TokenBatch(Wire, tag=_tag("TokenBatch")):
    """Scheduler -> detokenizer: new tokens per request (counts index into token_ids)."""

    rids: list[str]
    counts: list[int]
    token_ids: bytes  # int32
    finished: list[Finish] = []
    # Aligned with token_ids when any request in the batch asked for logprobs (else empty).
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    # A request's stop strings, in the first TokenBatch that mentions it: the detokenizer holds
    # back text that could be the start of one and cuts at Finish.stop_str when it ends.
    stops: dict[str, list[str]] = {}
    running: int = 0  # the scheduler's running and queued requests, for /metrics
    queued: int = 0
    replica: int = 0  # which scheduler (scheduler.dp) sent it
    # A request's prompt logprobs, whole, in the TokenBatch with its first token (or Finish).
    prompt_scores: dict[str, PromptScores] = {}
    # The scheduler's KV pages as it counted them at send, for /metrics, like running and
    # queued: [total, used, cached, free] (empty: not reported). Appended: field order is
    # the wire format.
    kv_pages: list[int] = []


class TextBatch(Wire, tag=_tag("TextBatch")):
    """Detokenizer -> tokenizer: safe text per request, the token ids behind it, and endings."""

    rids: list[str]
    texts: list[str]
    counts: list[int]
    token_ids: bytes  # int32
    finished: list[Finish] = []
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    running: int = 0
    queued: int = 0
    replica: int = 0
    prompt_scores: dict[str, PromptScores] = {}
    kv_pages: list[int] = []


class Ready(Wire, tag=_tag("Ready")):
    """An actor tells the launcher it is serving. `info` carries facts the launcher prints."""

    actor: str
    pid: int
    info: dict[str, str] = {}


class ActorFailed(Wire, tag=_tag("ActorFailed")):
    """An actor tells the launcher it is going down because of an error."""

    actor: str
    message: str


# Layer kinds, by the mlx-lm cache object each layer gets (docs/architecture.md, section 7):
# what a request keeps per layer, so what a cached prefix would have to hold for it.
LAYER_FULL = "full"  # KVCache: K and V of every position
LAYER_SLIDING = "sliding"  # RotatingKVCache: K and V of the last `window` positions only
LAYER_RECURRENT = "recurrent"  # ArraysCache (gated delta nets, Mamba): one state
LAYER_OTHER = "other"  # anything else, sent as "other:<cache type>"


class ModelLayers(Wire, tag=_tag("ModelLayers")):
    """Runner -> scheduler, once after loading: every layer's kind, in layer order. The
    scheduler decides from them what its prefix cache can hold, before it says Ready."""

    kinds: list[str]
    # The runner keeps the LM head's input with a snapshot (Op.head_input) and samples a row
    # from it: the model's output is its head's (nothing after it), and it has state slots.
    head_input: bool = False


# One union per inbox.
TokenizerInbox = Union[TextBatch, Shutdown]
SchedulerInbox = Union[TokenizedRequest, Abort, StepResult, Shutdown, ModelLayers]
RunnerInbox = Union[ForwardBatch, Shutdown]
DetokenizerInbox = Union[TokenBatch, Shutdown]
LauncherInbox = Union[Ready, ActorFailed]
