"""The config schema: TOML decoded into frozen structs that reject unknown keys and bad values.

`--set a.b=c` overrides are merged into the TOML dict before the one conversion, so every error
names the key path ("Object contains unknown field `max_runing` - at `$.scheduler`").
"""

from __future__ import annotations

import ipaddress
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Port = Annotated[int, Meta(ge=0, le=65535)]
Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0)]


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


# The built-ins (models/builtin.py) and their format variants (models/formats.py).
BUILTIN_NAME = (r"^(qwen3-tiny|qwen3-small|qwen3-chat-tiny|qwen3-chat-small|qwen3_5-tiny|"
                r"qwen3_5-small|gemma3-tiny)"
                r"(-[234568]bit(-g(32|64|128))?|-(mxfp4|mxfp8)(-g32)?|-nvfp4(-g16)?)?"
                r"(-(bf16|fp16))?$")


class ModelConfig(Section):
    # A built-in model the project builds on first use, used when `path` is empty.
    # A built-in, or one of its format variants made by mlx_lm.convert (models/formats.py):
    # qwen3-small-4bit, qwen3-tiny-3bit-g32, qwen3-tiny-mxfp4, qwen3_5-tiny-bf16, -fp16,
    # qwen3-small-4bit-bf16, ...
    builtin: Annotated[str, Meta(pattern=BUILTIN_NAME)] = "qwen3-small"
    # Any local mlx-lm model directory (config.json, *.safetensors, tokenizer files), or a
    # Hugging Face repo id, `org/name` or `org/name@revision` (models/hub.py): taken from the
    # Hugging Face cache, else downloaded before the actors start.
    path: str = ""
    # The repo's revision (branch, tag or commit) where `path` is a repo id without `@rev`.
    revision: str = ""
    # The model name clients use (/v1/models, the "model" field of responses); empty: the
    # repo id as given, the directory's name, or the built-in's name.
    name: str = ""
    # Where built-in models are cached; empty: $MAS_CACHE_DIR or ~/.cache/mlx-actor-serve/models.
    cache_dir: str = ""
    # Longest prompt + output; 0 takes max_position_embeddings from the model's config.
    context_length: Annotated[int, Meta(ge=0)] = 0


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: Port = 30000  # ZMQ client endpoint; 0 picks a free port (printed in the ready line)
    # Folder for the ipc:// inboxes inside the graph; empty: a fresh short folder under /tmp.
    ipc_dir: str = ""
    # OpenAI-compatible HTTP API on the same host; 0 picks a free port, -1 turns it off.
    http_port: Annotated[int, Meta(ge=-1, le=65535)] = 8000
    # A request naming a model other than model.name: false serves it anyway (clients set up
    # for another provider keep working); true answers 404 model_not_found, as vLLM does.
    strict_model_name: bool = False
    # When set, every HTTP route but /health needs "Authorization: Bearer KEY" (or Anthropic's
    # "x-api-key: KEY"), and every ZMQ request its api_key field (Client(api_key=...),
    # mas-client --api-key).
    api_key: str = ""
    # /v1/responses with store (its default): responses kept for previous_response_id and
    # GET /v1/responses/{id}, least recently used dropped past either bound.
    response_store_items: Annotated[int, Meta(ge=0)] = 1024
    response_store_mib: Annotated[int, Meta(ge=0)] = 64
    # /health with no step finished in the last health_recent_s seconds sends a one-token
    # probe request through all four actors; 503 unless it is answered within
    # health_timeout_s seconds.
    health_timeout_s: Annotated[float, Meta(gt=0)] = 20.0
    health_recent_s: Annotated[float, Meta(ge=0)] = 5.0
    # ZMQ CURVE on the client endpoint (encrypted, and the server proven by its key): the
    # server's keypair as Z85 text, 40 characters each (zmq.curve_keypair()), or instead
    # curve_key_file, a secret certificate written by zmq.auth.create_certificates (the
    # `.key_secret` file). Clients pass the public key: Client(server_key=...), --server-key.
    curve_public_key: str = ""
    curve_secret_key: str = ""
    curve_key_file: str = ""
    # Inboxes at addresses of your choosing, by actor name ("scheduler", "runner-1",
    # "scheduler.1", ...): tcp://HOST:PORT for an actor that `launch --only NAME` starts on
    # another host. Every other inbox is ipc:// in ipc_dir.
    inboxes: dict[str, str] = {}

    def __post_init__(self) -> None:
        self.curve_keys()  # a malformed key fails the config load, naming the key
        for name, address in self.inboxes.items():
            if not address.startswith(("tcp://", "ipc://")):
                raise ValueError(f"server.inboxes.{name}: {address!r} is not a tcp:// or "
                                 "ipc:// address")

    def curve_keys(self) -> tuple[bytes, bytes] | None:
        """(public, secret) when CURVE is on, else None. ValueError naming the key that is not
        usable (never showing a secret)."""
        inline = bool(self.curve_public_key or self.curve_secret_key)
        if not inline and not self.curve_key_file:
            return None
        import zmq

        if not zmq.has("curve"):
            raise ValueError("server.curve_*: this pyzmq's libzmq has no CURVE support")
        if inline and self.curve_key_file:
            raise ValueError("server.curve_key_file: give either the key file or "
                             "server.curve_public_key and server.curve_secret_key, not both")
        if inline:
            public = _z85_key("server.curve_public_key", self.curve_public_key)
            secret = _z85_key("server.curve_secret_key", self.curve_secret_key)
        else:
            public, secret = _key_file(self.curve_key_file)
        if zmq.curve_public(secret) != public:
            where = ("server.curve_key_file" if self.curve_key_file
                     else "server.curve_public_key")
            raise ValueError(f"{where}: the public key is not the one of the secret key")
        return public, secret


Z85_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                      ".-:+=^!/*?&<>()[]{}@%$#")


def _z85_key(name: str, text: str) -> bytes:
    """A CURVE key as Z85 text (40 characters), or ValueError naming the key."""
    if not text:
        raise ValueError(f"{name}: missing (the public and the secret key go together)")
    if len(text) != 40 or not Z85_CHARS.issuperset(text):
        raise ValueError(f"{name}: expected a CURVE key of 40 Z85 characters "
                         f"(zmq.curve_keypair()), got {len(text)} characters"
                         + ("" if Z85_CHARS.issuperset(text) else " with some outside Z85"))
    return text.encode()


def _key_file(path: str) -> tuple[bytes, bytes]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(Path(path).expanduser())
    except (OSError, ValueError) as e:
        raise ValueError(f"server.curve_key_file: cannot read a certificate from {path}: "
                         f"{e}") from None
    if secret is None:
        raise ValueError(f"server.curve_key_file: {path} holds no secret-key (give the "
                         "`.key_secret` file that zmq.auth.create_certificates writes)")
    return (_z85_key("server.curve_key_file public-key", public.decode("latin-1")),
            _z85_key("server.curve_key_file secret-key", secret.decode("latin-1")))


class SchedulerConfig(Section):
    # Requests decoding at once. auto: sized by the launcher from the KV pool (its tokens over
    # auto_context_tokens) and capped where the decode step's throughput stops growing for
    # this model on this machine (a short calibration at the first launch, cached:
    # launch/sizing.py); the ready line and the runner.ready log say the value and why.
    max_running_requests: Annotated[int, Meta(ge=1, le=4096)] | Literal["auto"] = "auto"
    # max_running_requests = auto: the context (prompt and output tokens) a request is
    # expected to hold, which the KV pool must have room for at every running request.
    auto_context_tokens: Annotated[int, Meta(ge=1)] = 2048
    # Requests waiting for admission; beyond this a new one gets a "queue full" error at once.
    max_queued_requests: Annotated[int, Meta(ge=0)] = 1024
    # Send step N+1 before processing step N's result, so the runner never waits for Python.
    overlap: bool = True
    # Prompt tokens prefilled per step; longer prompts are split into chunks of this size and
    # run in the same steps as the running requests' decode rows.
    chunked_prefill_size: Annotated[int, Meta(ge=1)] = 512
    # true: while more requests wait for admission than rows decode (a burst of clients),
    # steps prefill only and the decoding rows sit them out (sglang's default). Off by
    # default: on qwen3-small (2-core EPYC, 64 clients at once, 128-token prompts) it cut the
    # TTFT p50 by ~8% but the throughput by ~11% (decode rows riding along a prefill step cost
    # less than decode steps of their own) and made the decoders' longest gap 2.4x.
    prefill_first: bool = False
    # true: a queued prompt the prefix cache mostly holds (an agent's next turn) is admitted
    # before the long prompts queued and running ahead of it (a bounded number of times per
    # head of the queue). 8 Claude Code sessions at once on qwen3-chat-small: the second
    # turn's TTFT median 3.1 s, against 56 s strictly first come, first served.
    cached_first: bool = True
    # KV slots a request must find free beyond its prompt to be admitted (capped by its
    # max_new_tokens); decode beyond that is covered by retracting the least advanced request.
    output_reserve_tokens: Annotated[int, Meta(ge=0)] = 64
    # Data parallel: this many scheduler + model-runner pairs (each runner.tp ranks) behind the
    # one tokenizer and detokenizer. The tokenizer sends a request to the replica that holds
    # the longest cached prefix of it, else to the least loaded (actors/tokenizer/router.py).
    dp: Annotated[int, Meta(ge=1, le=64)] = 1


class RuntimeConfig(Section):
    # The BLAS behind MLX's CPU matmuls (Linux): auto takes MKL (the `mkl` wheel) if installed,
    # else Debian's OpenBLAS, else the mlx-cpu wheel's reference BLAS ("bundled"), which is
    # 10-20x slower in float32. macOS always uses MLX's own (Accelerate, Metal).
    blas: Literal["auto", "mkl", "openblas", "bundled"] = "auto"
    # CPU only: decode-shaped matmuls (x @ W.T for 2-128 rows) computed as (W @ x.T).T, which
    # the BLAS runs 1.2-2x faster (actors/model_runner/cpu/skinny.py).
    skinny_matmul: bool = True
    # CPU only: the attention softmax and the MLP's SiLU of large (prefill) shapes computed by
    # NumPy, whose exp is vectorized on x86 where MLX's is not (actors/model_runner/cpu/fastmath.py).
    fast_math: bool = True
    # CPU only: how weights stored in another format than float32 (4-bit, 8-bit, bf16, ...)
    # are multiplied (actors/model_runner/cpu/weights.py). auto: the compiled kernels (native/)
    # where they cover the format, else jit; jit: MLX's own kernel for one row, dequantized to
    # float32 just in time for more rows (forces the fallback); resident: upcast to float32 once
    # at load, within weight_memory_budget_mib; mlx: MLX's own kernels only.
    weights: Literal["auto", "jit", "resident", "mlx"] = "auto"
    # The dtype of the activations (and so of the KV cache) of a bf16/fp16 checkpoint. model:
    # the checkpoint's, greedy tokens those of mlx_lm.generate on it. float32: weights stay as
    # stored, everything else runs in float32, as mlx-lm on the checkpoint upcast to float32
    # (model.set_dtype(mx.float32)) does; on x86 CPUs MLX's bf16/fp16 norms, RoPE, attention
    # and SiLU are scalar code, and the decode attention kernel and fast math are float32 only.
    # KV memory is then 4 bytes a value (memory.kv_fraction sizes it so).
    activations: Literal["model", "float32"] = "model"
    # Float32 copies "resident" may keep, in MiB; 0: half the physical memory.
    weight_memory_budget_mib: Annotated[int, Meta(ge=0)] = 0
    # CPU only: freed MLX buffers the runner keeps for reuse, in MiB (MLX's own limit is 32
    # MiB here). A prefill chunk's attention scores (64 MiB per layer at 2,000 tokens) are then
    # reused from layer to layer instead of fresh pages each time, whose first touch costs
    # ~10 us per 4 KiB page on this project's VMs. 0: MLX's default. auto: two layers'
    # attention scores of a whole prefill chunk over the longest context the KV budget holds,
    # 64-1024 MiB (models/sizing.py): with a step's live arrays, the runner's workspace, which
    # memory.kv_fraction counts beside the KV pool.
    buffer_cache_mib: Annotated[int, Meta(ge=0)] | Literal["auto"] = "auto"
    # CPU only, with the compiled kernels: plain greedy rows' next token from an int8 copy of
    # a float32 or bf16 LM head with error bounds, the few rows that can still win multiplied
    # exactly (actors/model_runner/cpu/greedy_head.py): the same token as the argmax of the
    # full head, at a fraction of its cost. One byte per head weight more memory.
    greedy_head: bool = True
    # CPU only, with the compiled kernels, dense and hybrid models (not sliding windows) on one
    # rank: the decode forward traced once per shape by mx.compile (without fusion: the same
    # ops, the same tokens) and replayed, instead of built op by op in Python every step
    # (actors/model_runner/compiled_decode.py).
    compile_decode: bool = True
    # Hybrid models (Qwen3.5, Qwen3-Next), off Metal: the gated-delta recurrence of a prompt
    # chunk in blocks of matrix products instead of one token at a time (12-15x faster per
    # layer), and the layers' short causal convolution as shifted sums instead of MLX's CPU
    # convolution (actors/model_runner/chunked_delta.py). false: mlx-lm's own, as before.
    linear_prefill: bool = True
    # CPU only (Linux, compiled kernels, one runner process on the machine, 2+ CPUs): MLX's
    # stream thread, which runs every kernel of a step in turn, on a core of its own, and every
    # other thread of the graph (the other actors, the runner's Python, the kernels' and the
    # BLAS's workers) on the other cores, so a wake-up elsewhere never stalls the step
    # (actors/model_runner/cpu/cores.py; qwen3-small-4bit served at one request on 2 cores:
    # +12-14% tokens/s). The runner.cores log says what was pinned, or why not.
    pin_stream: bool = True


class RunnerConfig(Section):
    """Tensor parallelism: the model runner as `tp` ranks of one mlx.distributed group, each
    holding 1/tp of every sharded layer (mlx-lm's `model.shard()`)."""

    tp: Annotated[int, Meta(ge=1, le=64)] = 1
    # mlx.distributed's backend. ring: TCP between the hosts below (set up by launch); jaccl
    # (Thunderbolt RDMA) and mpi read their own environment, set as `mlx.launch` would.
    backend: Literal["ring", "jaccl", "mpi"] = "ring"
    # One IP per rank, rank 0 first; empty: every rank on this machine over loopback.
    hosts: list[str] = []
    # The ring's first TCP port (rank k listens on port + k); 0: free ports picked at launch
    # (one machine only).
    port: Port = 0
    # A step that has not finished after this long means a rank stalled: the rank exits, and
    # the graph stops as for any dead actor (tp > 1 only).
    step_timeout_s: Seconds = 120.0

    def __post_init__(self) -> None:
        if self.hosts and len(self.hosts) != self.tp:
            raise ValueError(f"runner.hosts: one IP per rank, got {len(self.hosts)} for "
                             f"tp = {self.tp}")
        if self.port and self.port + self.tp - 1 > 65535:
            raise ValueError(f"runner.port: ports {self.port}..{self.port + self.tp - 1} "
                             f"do not all exist")
        if self.tp > 1 and self.backend == "ring" and not self.port and not self.on_one_host():
            raise ValueError("runner.port: hosts on several machines need a fixed first port")

    def on_one_host(self) -> bool:
        """Every rank on this machine: no hosts given, or one loopback address however written
        ("localhost", "127.0.0.1"). Distinct loopback addresses (127.0.0.1, 127.0.0.2) stand
        for distinct hosts: that is how a multi-host layout is tried on one machine."""
        names = {"127.0.0.1" if h == "localhost" else h.strip("[]") for h in self.hosts}
        return len(names) <= 1 and all(is_loopback(h) for h in names)


class MemoryConfig(Section):
    # KV capacity in tokens, whole pages of 16 of the one KV pool (the runner holds no more);
    # 0: kv_fraction of physical memory holds the pool and the runner's workspace
    # (runtime.buffer_cache_mib) together.
    kv_tokens: Annotated[int, Meta(ge=0)] = 0
    kv_fraction: Annotated[float, Meta(gt=0, le=0.9)] = 0.25
    # Recurrent-state and sliding-window slots (live requests + prefix snapshots); 0: the
    # running requests + 64 where max_running_requests is auto (launch/sizing.py), else four
    # per running request.
    state_slots: Annotated[int, Meta(ge=0)] = 0


class CacheConfig(Section):
    # Radix prefix cache: a prompt that starts with a cached prefix skips recomputing it.
    prefix: bool = True
    # Hybrid and sliding-window models: prefill chunks end at multiples of this many tokens,
    # where the recurrent state (or the window) is snapshotted, so a shared prefix resumes at most this far before its end.
    snapshot_interval: Annotated[int, Meta(ge=0)] = 128


class LimitsConfig(Section):
    """What one client request may hold, on both APIs (ZMQ frames and HTTP bodies). Past a limit
    the request gets a 400 naming it (a 413 for an HTTP body); nothing past one reaches the tokenizer or the graph."""

    max_frame_bytes: Positive = 16 << 20  # one ZMQ request frame
    max_body_bytes: Positive = 16 << 20  # one HTTP request body
    # Nesting of arrays and maps anywhere in a request (JSON bodies, chat_template_kwargs).
    max_depth: Annotated[int, Meta(ge=4, le=1000)] = 64
    max_string_chars: Positive = 4 << 20  # any one string (a prompt, a message, a stop string)
    max_list_items: Positive = 1 << 20  # any one list or map (input_ids, messages, logit_bias)
    max_stop_strings: Positive = 16
    # /v1/completions with a list of prompts: how many prompts, and choices (prompts x n).
    max_prompts: Positive = 64
    max_choices: Positive = 256
    max_request_tokens: Positive = 1 << 20  # the prompts of one such request together
    # A constraint (json_schema, regex, ebnf, structural_tag) must compile within this long,
    # or the request is refused naming it.
    grammar_timeout_s: Seconds = 10.0
    # Output tokens of any one request (a client asking more gets this many, finish reason
    # length); 0: up to what the model's context leaves. Agents ask 32k and more by default.
    max_output_tokens: Annotated[int, Meta(ge=0)] = 0


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # auto: console when stderr is a terminal, JSON lines otherwise.
    format: Literal["auto", "json", "console"] = "auto"
    stderr: bool = True
    # Every run also writes JSON lines to a file of its own in this folder,
    # `<YYYYmmdd-HHMMSS>-<launcher pid>.jsonl`, named by the ready line (`launch logs FILE`
    # reads it). Empty: no file unless `file` is set.
    dir: str = "~/.cache/mlx-actor-serve/logs"
    file: str = ""  # this file instead of a new one in `dir` (appended to if it exists)
    # Past this size the launcher rotates the file (FILE -> FILE.1 -> ... FILE.<backups>, the
    # oldest dropped), so one run takes at most max_file_mib * (backups + 1) of disk.
    max_file_mib: Annotated[int, Meta(ge=1, le=1 << 20)] = 64
    backups: Annotated[int, Meta(ge=0, le=100)] = 4
    # Run files kept in `dir`: a new run deletes the oldest ones beyond this count.
    keep_runs: Annotated[int, Meta(ge=1, le=100_000)] = 20
    # How often the runner logs its utilisation (busy fraction, steps/s) while it has work.
    stats_interval_s: Seconds = 5.0


class LaunchConfig(Section):
    ready_timeout_s: Seconds = 300.0  # the first start builds the built-in model
    drain_timeout_s: Seconds = 10.0
    stop_timeout_s: Seconds = 5.0  # after drain: wait this long, then terminate, then kill


class Config(Section):
    model: ModelConfig = ModelConfig()
    server: ServerConfig = ServerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    memory: MemoryConfig = MemoryConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    runner: RunnerConfig = RunnerConfig()
    cache: CacheConfig = CacheConfig()
    limits: LimitsConfig = LimitsConfig()
    log: LogConfig = LogConfig()
    launch: LaunchConfig = LaunchConfig()

    def runners_here(self) -> int:
        """Runner processes sharing this machine's cores and memory: every rank of every
        replica when they all run here, else (ranks on several machines) one."""
        return self.runner.tp * self.scheduler.dp if self.runner.on_one_host() else 1


class ConfigError(ValueError):
    pass


def is_loopback(host: str) -> bool:
    """Only this machine can reach a socket bound on host."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name, "*", or an interface: reachable from elsewhere as far as we know
        return False


def _parse_value(text: str) -> Any:
    """A --set value is read as a TOML value (numbers, booleans, quoted strings, arrays);
    anything TOML cannot read is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects section.key=value, got {assignment!r}")
    path = key.strip().split(".")
    node = raw
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: `{part}` is not a section")
        node = child
    node[path[-1]] = _parse_value(value.strip())


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid config: {e}") from None


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
