"""The benchmark's lean streaming client (benchmarks/serving/lean_client.py): against our real
server it reads the same text and usage as the official `openai` client; against a scripted
HTTP server, both body framings (chunked, and raw until close), LF and CRLF events split
across reads, an error status named in the sample, and a stream cut short an error."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from benchmarks.serving.lean_client import stream_completion
from benchmarks.serving.load import Target, closed_loop, one_lean


def _events(texts: list[str], usage: dict, end: bytes = b"\n") -> list[bytes]:
    out = [b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + end + end
           for t in texts]
    out.append(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + end + end)
    return out + [b"data: [DONE]" + end + end]


async def _scripted(pieces: list[bytes], chunked: bool, status: bytes = b"200 OK",
                    last_chunk: bool = True):
    """A one-shot HTTP server that answers any request with `pieces`, flushed one by one."""
    async def handle(reader, writer):
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # the request's headers; the body is never read
        head = b"HTTP/1.1 " + status + b"\r\nContent-Type: text/event-stream\r\n"
        writer.write(head + (b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"\r\n"))
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
            await asyncio.sleep(0.001)
        if chunked and last_chunk:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
@pytest.mark.parametrize("chunked", [True, False])
def test_events_are_read_in_both_framings_even_split_across_reads(chunked, end):
    usage = {"prompt_tokens": 5, "completion_tokens": 3}
    whole = b"".join(_events(["a", "", "b c"], usage, end))
    # Cut the stream at awkward places: inside an event, between its two line ends, inside a
    # CRLF.
    cuts = sorted({0, 7, 31, whole.index(end + end) + len(end), whole.index(end) + 1,
                   len(whole) - 3, len(whole)})
    pieces = [whole[a:b] for a, b in zip(cuts, cuts[1:])]

    async def run():
        server, url = await _scripted(pieces, chunked)
        got = []
        async with server:
            await stream_completion(url, {"prompt": "x"}, lambda e, t: got.append(e))
            sample = await one_lean(Target("t", url, "m", {}), "x", 3)
        return got, sample

    got, sample = asyncio.run(run())
    assert [e["choices"][0]["text"] for e in got if e["choices"]] == ["a", "", "b c"]
    assert got[-1]["usage"] == usage
    # The empty text is no content chunk; the usage gives the token count.
    assert len(sample.chunks) == 2 and sample.tokens == 3 and sample.prompt_tokens == 5
    assert not sample.error


@pytest.mark.parametrize("chunked", [True, False])
def test_a_stream_cut_short_is_an_error(chunked):
    whole = b"".join(_events(["a", "b"], {"prompt_tokens": 1, "completion_tokens": 2}))
    cut = whole[:whole.index(b"data: [DONE]")]

    async def run():
        server, url = await _scripted([cut], chunked)
        async with server:
            return await one_lean(Target("t", url, "m", {}), "x", 2)

    sample = asyncio.run(run())
    assert "DONE" in sample.error and len(sample.chunks) == 2


def test_a_connection_closed_inside_a_chunked_body_is_an_error():
    whole = b"".join(_events(["a"], {"prompt_tokens": 1, "completion_tokens": 1}))

    async def run():
        server, url = await _scripted([whole[:20]], True, last_chunk=False)
        async with server:
            return await one_lean(Target("t", url, "m", {}), "x", 1)

    assert "IncompleteReadError" in asyncio.run(run()).error


def test_an_error_status_is_recorded_with_its_body():
    async def run():
        server, url = await _scripted([b'{"error": "no such model"}'], False,
                                      status=b"404 Not Found")
        async with server:
            return await one_lean(Target("t", url, "m", {}), "x", 3)

    sample = asyncio.run(run())
    assert "404" in sample.error and "no such model" in sample.error and not sample.chunks


@pytest.mark.slow
def test_it_reads_what_the_official_client_reads_from_our_server(graph):
    api = openai.OpenAI(base_url=graph.http + "/v1", api_key="unused", max_retries=0)
    prompt = "The quick brown fox"
    want = api.completions.create(model="qwen3-tiny", prompt=prompt, max_tokens=20,
                                  temperature=0, extra_body={"ignore_eos": True})
    body = {"model": "qwen3-tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    asyncio.run(stream_completion(graph.http + "/v1", body, lambda e, t: events.append(e)))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == want.choices[0].text
    assert events[-1]["usage"]["completion_tokens"] == 20 == want.usage.completion_tokens
    target = Target("ours", graph.http + "/v1", "qwen3-tiny", {"ignore_eos": True})
    samples, _ = asyncio.run(closed_loop(target, [prompt, prompt], 2, 20, client_kind="lean"))
    assert all(not s.error and s.tokens == 20 and s.chunks for s in samples)
    samples, _ = asyncio.run(closed_loop(target, [prompt], 1, -5, client_kind="lean"))
    assert "400" in samples[0].error and "max_tokens" in samples[0].error
