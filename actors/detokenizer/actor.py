"""The detokenizer actor: TokenBatch in, TextBatch out. Thin shell around the pure core."""

from __future__ import annotations

from actors.detokenizer.core import Detokenizer
from actors.shell import Shell, run_actor
from actors.tokenizer.loading import load_tokenizer
from protocol import messages as m
from protocol.codec import split_counts, unpack_ids


def convert(core: Detokenizer, batch: m.TokenBatch) -> m.TextBatch:
    pieces = split_counts(unpack_ids(batch.token_ids), batch.counts)
    texts = [core.feed(rid, ids) for rid, ids in zip(batch.rids, pieces)]
    rids, counts = list(batch.rids), list(batch.counts)
    for fin in batch.finished:
        tail = core.finish(fin.rid)
        if fin.rid in rids:
            texts[rids.index(fin.rid)] += tail
        elif tail:
            rids.append(fin.rid); texts.append(tail); counts.append(0)
    return m.TextBatch(rids=rids, texts=texts, counts=counts, token_ids=batch.token_ids,
                       finished=batch.finished)


async def serve(shell: Shell) -> None:
    tokenizer = load_tokenizer(shell.model.path)
    # EOS ends a request; it is never part of the text (as in mlx_lm.generate and OpenAI).
    core = Detokenizer(tokenizer.decode, skip_ids=shell.model.eos_ids)
    inbox = shell.bind_inbox(m.DetokenizerInbox)
    await shell.ready()
    while True:
        for msg in await inbox.recv_all():
            match msg:
                case m.TokenBatch():
                    await shell.send("tokenizer", convert(core, msg))
                case m.Shutdown():
                    return


def main(cfg, addrs, model) -> None:
    run_actor("detokenizer", cfg, addrs, model, serve)
