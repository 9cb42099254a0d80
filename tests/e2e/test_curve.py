"""Security of the ZMQ client endpoint: CURVE encryption with the server's keypair, the
api_key on ZMQ requests, key config checked at load, and the warning for an open bind."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.auth

from actors.tokenizer.actor import insecure_endpoints
from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient, Client, ServerError
from protocol.config import ConfigError, ServerConfig, is_loopback, load_config

API_KEY = "open-sesame"


# -- config, no graph -------------------------------------------------------------------------


def test_inline_keys_load_and_must_be_a_pair():
    public, secret = zmq.curve_keypair()
    cfg = load_config(None, [f'server.curve_public_key="{public.decode()}"',
                             f'server.curve_secret_key="{secret.decode()}"'])
    assert cfg.server.curve_keys() == (public, secret)
    assert load_config().server.curve_keys() is None
    other = zmq.curve_keypair()[0].decode()
    cases = {
        "server.curve_secret_key": [f'server.curve_public_key="{public.decode()}"',
                                    'server.curve_secret_key="short"'],
        "server.curve_public_key": [f'server.curve_secret_key="{secret.decode()}"'],
        "server.curve_public_key: the public key is not": [
            f'server.curve_public_key="{other}"', f'server.curve_secret_key="{secret.decode()}"'],
    }
    for named, overrides in cases.items():
        with pytest.raises(ConfigError, match=named) as err:
            load_config(None, overrides)
        assert secret.decode() not in str(err.value)  # a secret is never shown


def test_key_file_is_a_zmq_auth_secret_certificate(tmp_path):
    public_file, secret_file = zmq.auth.create_certificates(tmp_path, "server")
    cfg = load_config(None, [f'server.curve_key_file="{secret_file}"'])
    assert cfg.server.curve_keys() == zmq.auth.load_certificate(secret_file)
    with pytest.raises(ConfigError, match="server.curve_key_file: .* holds no secret-key"):
        load_config(None, [f'server.curve_key_file="{public_file}"'])
    with pytest.raises(ConfigError, match="server.curve_key_file: cannot read"):
        load_config(None, [f'server.curve_key_file="{tmp_path / "absent"}"'])


def test_an_open_bind_is_found():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("*") and not is_loopback("10.1.2.3")
    assert insecure_endpoints(ServerConfig(), curve=False, http=True) == []
    wide = ServerConfig(host="0.0.0.0")
    assert insecure_endpoints(wide, curve=False, http=True) == ["zmq", "http"]
    assert insecure_endpoints(wide, curve=True, http=True) == ["http"]
    assert insecure_endpoints(wide, curve=True, http=False) == []
    assert insecure_endpoints(ServerConfig(host="0.0.0.0", api_key="k"), False, True) == []


# -- a graph with CURVE and an api_key ----------------------------------------------------------


@pytest.fixture(scope="module")
def secured(model_cache, tmp_path_factory):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    public_file, secret_file = zmq.auth.create_certificates(tmp_path_factory.mktemp("keys"),
                                                            "server")
    g = Graph("model.builtin=qwen3-tiny", "server.http_port=-1",
              f'server.curve_key_file="{secret_file}"', f'server.api_key="{API_KEY}"')
    g.server_key = zmq.auth.load_certificate(public_file)[0]
    yield g
    assert g.stop() == 0


@pytest.mark.slow
def test_the_right_server_key_and_api_key_are_served(secured):
    with Client(secured.address, timeout=60, server_key=secured.server_key,
                api_key=API_KEY) as c:
        r = c.generate("Hello", max_new_tokens=4, ignore_eos=True)
        assert r.completion_tokens == 4 and r.text
        streamed = list(c.generate("Hello", max_new_tokens=4, ignore_eos=True, stream=True))
        assert streamed[-1].token_ids == r.token_ids

    async def served() -> int:
        async with AsyncClient(secured.address, server_key=secured.server_key.decode(),
                               api_key=API_KEY) as c:
            return (await c.generate("Hello", max_new_tokens=2)).completion_tokens

    assert asyncio.run(asyncio.wait_for(served(), 60)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("server_key, named", [
    (zmq.curve_keypair()[0], "is server_key the server's public key"),  # another server's key
    (None, "requires CURVE encryption: pass its public key"),
], ids=["another-servers-key", "no-key"])
def test_a_client_without_the_server_key_gets_a_clear_error_fast(secured, server_key, named):
    start = time.monotonic()
    with Client(secured.address, timeout=10, server_key=server_key, api_key=API_KEY) as c:
        with pytest.raises(ServerError, match=named):
            c.generate("Hello", max_new_tokens=2)
    assert time.monotonic() - start < 5

    async def refused() -> None:
        async with AsyncClient(secured.address, server_key=server_key, api_key=API_KEY) as c:
            await c.generate("Hello", max_new_tokens=2)

    with pytest.raises(ServerError, match=named):
        asyncio.run(asyncio.wait_for(refused(), 10))


@pytest.mark.slow
@pytest.mark.parametrize("api_key, named", [("", "missing api_key"),
                                            ("guess", "invalid api_key")])
def test_a_request_without_the_api_key_is_refused_and_the_server_goes_on(secured, api_key,
                                                                          named):
    with Client(secured.address, timeout=60, server_key=secured.server_key,
                api_key=api_key) as c:
        with pytest.raises(ServerError, match=named) as err:
            c.generate("Hello", max_new_tokens=2)
        assert err.value.code == 401 and API_KEY not in err.value.message
        c.api_key = API_KEY
        assert c.generate("Hello", max_new_tokens=2).completion_tokens == 2
    assert secured.wait_for("request.rejected", code=401)
