"""The detokenizer actor: TokenBatch in, TextBatch out. Thin shell around the pure core."""

from __future__ import annotations

from actors.detokenizer.core import Detokenizer
from actors.detokenizer.stops import StopTrimmer
from actors.shell import Shell, run_actor
from models.tokenizer import load_tokenizer
from protocol import messages as m
from protocol.codec import split_counts, unpack_ids


def convert(core: Detokenizer, stops: dict[str, StopTrimmer], batch: m.TokenBatch) -> m.TextBatch:
    for rid, strings in batch.stops.items():
        stops[rid] = StopTrimmer(strings)
    pieces = split_counts(unpack_ids(batch.token_ids), batch.counts)
    texts = [_trim(stops, rid, core.feed(rid, ids)) for rid, ids in zip(batch.rids, pieces)]
    rids, counts = list(batch.rids), list(batch.counts)
    for fin in batch.finished:
        tail = core.finish(fin.rid)
        k = rids.index(fin.rid) if fin.rid in rids else -1
        emitted = texts[k] if k >= 0 else ""
        trimmer = stops.pop(fin.rid, None)
        text = emitted + tail if trimmer is None else trimmer.end(emitted, tail, fin.stop_str)
        if k >= 0:
            texts[k] = text
        elif text:  # text held back until the end, with no new token in this batch
            rids.append(fin.rid)
            texts.append(text)
            counts.append(0)
    return m.TextBatch(rids=rids, texts=texts, counts=counts, token_ids=batch.token_ids,
                       finished=batch.finished, logprobs=batch.logprobs, top_ids=batch.top_ids,
                       top_logprobs=batch.top_logprobs, prompt_scores=batch.prompt_scores,
                       running=batch.running, queued=batch.queued, replica=batch.replica,
                       kv_pages=batch.kv_pages)


def _trim(stops: dict[str, StopTrimmer], rid: str, text: str) -> str:
    trimmer = stops.get(rid)
    return trimmer.push(text) if trimmer is not None else text


async def serve(shell: Shell) -> None:
    tokenizer = load_tokenizer(shell.model.path)
    # EOS ends a request; it is never part of the text (as in mlx_lm.generate and OpenAI).
    core = Detokenizer(tokenizer.decode, skip_ids=shell.model.eos_ids)
    stops: dict[str, StopTrimmer] = {}
    inbox = shell.bind_inbox(m.DetokenizerInbox)
    await shell.ready()
    while True:
        for msg in await inbox.recv_all():
            match msg:
                case m.TokenBatch():
                    text = convert(core, stops, msg)
                    for fin in msg.finished:  # per request, not per token
                        shell.log.debug("request.detokenized", rid=fin.rid, reason=fin.reason)
                    await shell.send("tokenizer", text)
                case m.Shutdown():
                    return


def main(cfg, addrs, model) -> None:
    run_actor("detokenizer", cfg, addrs, model, serve)
