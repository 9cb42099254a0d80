"""`launch [--model NAME_OR_DIR] [--config FILE] [--set section.key=value ...]`: resolve the
model, start the graph, print one `ready` line with the client address and the log file, and
supervise until stopped.

`launch logs [FILE] ...`: read a run's log file (launch/logs/)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import msgspec

from actors.logs import configure_logging, get_logger
from actors.titles import set_title
from models.info import ModelInfo
from launch.sizing import size
from protocol.config import Config, ConfigError, load_config
from protocol.transport import derive_addresses, graph_actors, parse_name


def resolve_model(cfg: Config, progress: bool = True) -> ModelInfo:
    """The model directory every actor loads: `model.path` (a directory, or a Hugging Face
    repo id resolved through the cache or a download: models/hub.py), or the built-in model,
    built and cached on first use."""
    from models import hub
    from models.info import read_model_info

    revision = ""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if path.is_dir():
            name = path.name
        elif hub.is_repo_id(cfg.model.path):
            got = hub.resolve(cfg.model.path, cfg.model.revision)
            path, name, revision = got.folder, got.repo_id, got.revision
        else:
            raise ConfigError(f"model.path {cfg.model.path!r} is neither a directory nor a "
                              "Hugging Face repo id (org/name or org/name@revision)")
    else:
        from models.builtin import ensure_builtin

        cache = Path(cfg.model.cache_dir).expanduser() if cfg.model.cache_dir else None
        path = ensure_builtin(cfg.model.builtin, cache_dir=cache, progress=progress)
        name = cfg.model.builtin
    info = read_model_info(str(path), name=cfg.model.name or name,
                           context_length=cfg.model.context_length)
    return msgspec.structs.replace(info, revision=revision)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch", description="Start the mlx-actor-serve graph. Without --config or "
        "--model it serves the built-in model on the default ports.",
        epilog="launch logs [FILE] --help: read a run's log file")
    p.add_argument("--model", metavar="NAME_OR_DIR",
                   help="a model directory, a Hugging Face repo id (org/name[@revision]: from "
                        "the HF cache, else downloaded) or a built-in's name; = --set "
                        "model.path=... (model.builtin=... for a built-in)")
    p.add_argument("--host", help="= --set server.host=...")
    p.add_argument("--port", type=int, help="ZMQ client port, 0 for a free one; = --set "
                                            "server.port=...")
    p.add_argument("--http-port", type=int, help="OpenAI HTTP port, 0 for a free one, -1 off; = "
                                                 "--set server.http_port=...")
    p.add_argument("--config", help="TOML config file (configs/qwen.toml); the flags above "
                                    "and --set override it")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable; "
                                                     "wins over the flags above)")
    p.add_argument("--only", metavar="ACTORS", default="",
                   help="start only these actors of the graph (comma separated, e.g. runner-1 "
                        "on the host of tensor-parallel rank 1); the rest runs elsewhere")
    p.add_argument("--except", dest="skip", metavar="ACTORS", default="",
                   help="start every actor but these (they are started elsewhere with --only)")
    return p.parse_args(argv)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The --model, --host, --port and --http-port flags as the --set overrides they equal."""
    from models import builtin

    out = []
    if args.model:
        named = args.model in builtin.BUILTINS or builtin.parse_variant(args.model) is not None
        if named and not Path(args.model).expanduser().is_dir():
            out.append(f"model.builtin={args.model}")
        else:
            out.append(f"model.path={args.model}")
    for flag, key in (("host", "server.host"), ("port", "server.port"),
                      ("http_port", "server.http_port")):
        if getattr(args, flag) is not None:
            out.append(f"{key}={getattr(args, flag)}")
    return out


def chosen_actors(cfg: Config, only: str, skip: str) -> list[str]:
    """The actors this launcher starts. By default every actor of the graph but the tensor-
    parallel ranks whose runner.hosts entry is not rank 0's: their hosts start them with
    --only."""
    every = graph_actors(cfg)
    named = {n.strip() for n in f"{only},{skip}".split(",") if n.strip()}
    if unknown := sorted(named - set(every)):
        raise ConfigError(f"--only/--except: no actor {', '.join(unknown)} in this graph "
                          f"(its actors: {', '.join(every)})")
    if only:
        return [n for n in every if n in named]
    hosts = cfg.runner.hosts
    remote = set() if cfg.runner.on_one_host() else {
        n for n in every if parse_name(n)[0] == "runner" and hosts[parse_name(n)[2]] != hosts[0]}
    return [n for n in every if n not in remote and n not in named]


def with_run_log(cfg: Config) -> Config:
    """The config every process gets: `log.file` set to this run's file (log.dir, log.file),
    so the launcher and the four actors append to the one file. A folder that cannot be
    written costs the file, not the run."""
    from launch.logs.files import prepare_run_file

    try:
        path = prepare_run_file(cfg.log, time.time(), os.getpid())
    except OSError as e:
        print(f"launch: no log file ({e}); set log.dir or log.file", file=sys.stderr)
        path = ""
    return msgspec.structs.replace(cfg, log=msgspec.structs.replace(cfg.log, file=path))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    set_title("mas-launch")  # ps and top tell the launcher from the actors
    if argv[:1] == ["logs"]:
        from launch.logs import main as logs_main

        return logs_main(argv[1:])
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, flag_overrides(args) + args.overrides)
    except ConfigError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    cfg = with_run_log(cfg)
    configure_logging(cfg.log, "launcher")
    log = get_logger()
    try:
        from actors.model_runner.entry import preflight

        preflight(cfg)  # a BLAS asked for by name must be here
        actors = chosen_actors(cfg, args.only, args.skip)
        model = resolve_model(cfg)
        cfg, sizing = size(cfg, model)
        model = msgspec.structs.replace(model, sizing=sizing.why)
    except (ConfigError, OSError, ValueError) as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    try:
        addrs = derive_addresses(cfg)
    except ValueError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    log.info("launch.sizing", max_running_requests=sizing.value, why=sizing.why,
             decode_tok_s_by_rows={str(b): r for b, r in sorted(sizing.rates.items())} or None)
    log.info("launch.start", model=model.name, path=model.path,
             revision=model.revision or None, ipc_dir=addrs.ipc_dir,
             log_file=cfg.log.file or None, actors=actors)

    def on_ready(info: dict[str, str]) -> None:
        if "tokenizer" not in actors:  # a part of a graph whose front door runs elsewhere
            log.info("launch.ready", actors=actors, log_file=cfg.log.file or None)
            print(f"mlx-actor-serve part ready: {', '.join(actors)}", flush=True)
            return
        client = info.get("client", addrs.client)
        http = f" http {info['http']}" if "http" in info else ""
        logs = f" log {cfg.log.file}" if cfg.log.file else ""
        log.info("launch.ready", client=client, http=info.get("http"),
                 log_file=cfg.log.file or None)
        # Where the model came from, last: the client address stays where scripts read it.
        source = f" from {model.path}" + (f" revision {model.revision}" if model.revision else "")
        print(f"mlx-actor-serve ready: model {model.name} client {client}{http}{logs}{source}"
              f"; max_running_requests {sizing.value} ({sizing.why}); {kv_pool(cfg, model)}",
              flush=True)

    from launch.supervisor import Supervisor

    return asyncio.run(Supervisor(cfg, addrs, model, on_ready, actors).run())


def kv_pool(cfg: Config, model: ModelInfo) -> str:
    """The KV pool as the ready line gives it: pages, their bytes, the runner's workspace
    (models/sizing.py; per runner rank under tensor parallelism)."""
    from models.sizing import kv_bytes_per_token, kv_capacity, workspace_bytes
    from protocol.messages import KV_PAGE

    pages = kv_capacity(cfg, model) // KV_PAGE
    mib = pages * KV_PAGE * kv_bytes_per_token(cfg, model) / 2**20
    return (f"kv pool {pages} pages of {KV_PAGE} tokens ({mib:.0f} MiB), workspace "
            f"{workspace_bytes(cfg, model) >> 20} MiB")


if __name__ == "__main__":
    sys.exit(main())
