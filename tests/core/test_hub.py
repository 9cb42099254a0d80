"""Models named by Hugging Face repo ids (models/hub.py, launch/cli.py): resolved from a real
Hugging Face cache layout (models--org--name/snapshots/<rev>/, refs/main) offline, the
revision picked by `@rev` or model.revision, an uncached id refused at once with the cache
folder and the download command, and the launch flags that equal --set keys."""

import shutil
import time
from pathlib import Path

import pytest

from launch.cli import flag_overrides, parse_args, resolve_model
from models import hub
from models.builtin import ensure_builtin
from protocol.config import ConfigError, load_config
from tests.support.hub import REV_MAIN, REV_OLD, cache_model

@pytest.fixture
def hf_cache(tmp_path, model_cache, monkeypatch):
    """An offline HF cache holding test-org/tiny at two revisions: main is qwen3-tiny, the
    older one gemma3-tiny."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    qwen = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    gemma = ensure_builtin("gemma3-tiny", cache_dir=model_cache, progress=False)
    cache_model(cache, "test-org/tiny", qwen, REV_MAIN, main=True)
    cache_model(cache, "test-org/tiny", gemma, REV_OLD, main=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_repo_resolves_to_its_snapshot_at_main_or_the_revision_asked(hf_cache):
    got = hub.resolve("test-org/tiny")
    assert got.folder == hf_cache / "models--test-org--tiny" / "snapshots" / REV_MAIN
    assert (got.repo_id, got.revision) == ("test-org/tiny", REV_MAIN)
    assert hub.resolve(f"test-org/tiny@{REV_OLD}").revision == REV_OLD
    assert hub.resolve("test-org/tiny", revision=REV_OLD).revision == REV_OLD
    with pytest.raises(ValueError, match="names revision .* but model.revision is"):
        hub.split_revision(f"test-org/tiny@{REV_OLD}", REV_MAIN)


def test_an_uncached_repo_fails_at_once_naming_the_cache_and_the_command(hf_cache):
    start = time.monotonic()
    with pytest.raises(hub.ModelNotFound) as e:
        hub.resolve("test-org/absent@v2")
    assert time.monotonic() - start < 5
    message = str(e.value)
    assert "test-org/absent@v2" in message and str(hf_cache) in message
    assert "`hf download test-org/absent --revision v2`" in message
    assert "HF_HUB_OFFLINE" in message


@pytest.mark.parametrize("spec, repo", [
    ("org/name", True), ("mlx-community/Qwen3-0.6B-4bit", True), ("org/name@abc", True),
    ("./org/name", False), ("~/models/x", False), ("/abs/path", False), ("a/b/c", False),
    ("name", False), ("org/", False),
])
def test_repo_ids_are_told_from_paths(spec, repo):
    assert hub.is_repo_id(spec) == repo


def test_launch_resolves_a_repo_id_and_names_the_model_by_it(hf_cache):
    info = resolve_model(load_config(None, ["model.path=test-org/tiny"]))
    assert (info.name, info.revision) == ("test-org/tiny", REV_MAIN)
    assert info.path.endswith(REV_MAIN) and info.model_type == "qwen3"
    old = resolve_model(load_config(None, [f"model.path=test-org/tiny@{REV_OLD}"]))
    assert (old.name, old.model_type) == ("test-org/tiny", "gemma3_text")
    named = resolve_model(load_config(None, ["model.path=test-org/tiny", "model.name=tiny"]))
    assert named.name == "tiny"
    with pytest.raises(hub.ModelNotFound, match="test-org/absent"):
        resolve_model(load_config(None, ["model.path=test-org/absent"]))
    with pytest.raises(ConfigError, match="neither a directory nor a Hugging Face repo id"):
        resolve_model(load_config(None, ["model.path=./no/such/dir"]))


def test_a_directory_is_named_by_its_folder(model_cache, tmp_path):
    folder = tmp_path / "my-model"
    shutil.copytree(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False), folder)
    info = resolve_model(load_config(None, [f"model.path={folder}"]))
    assert (info.name, info.revision, info.path) == ("my-model", "", str(folder))


def test_the_flags_equal_their_set_keys_and_set_wins():
    args = parse_args(["--model", "org/name", "--port", "0", "--http-port", "-1", "--host",
                       "0.0.0.0", "--set", "server.port=7"])
    assert flag_overrides(args) == ["model.path=org/name", "server.host=0.0.0.0",
                                    "server.port=0", "server.http_port=-1"]
    cfg = load_config(None, flag_overrides(args) + args.overrides)
    assert (cfg.model.path, cfg.server.port, cfg.server.http_port) == ("org/name", 7, -1)
    assert flag_overrides(parse_args(["--model", "qwen3-tiny-4bit"])) == [
        "model.builtin=qwen3-tiny-4bit"]  # a built-in's name
    assert flag_overrides(parse_args([])) == []
