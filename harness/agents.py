"""The real coding-agent CLIs against a served model: Claude Code (`claude -p`, Anthropic's
/v1/messages) and Codex (`codex exec`, OpenAI's /v1/responses), installed from npm at pinned
versions into a cache folder, each conversation run in a throwaway HOME and working folder with
every other kind of traffic off. Put a harness.proxy.RecordingProxy in front of the server to see
what they send and get."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.328"
CODEX = "@openai/codex@0.169.0"


class AgentsUnavailable(RuntimeError):
    """The CLIs cannot be installed here; the message says why (tests skip with it)."""


def agents_dir() -> Path:
    """The installs, beside the built-in models' cache (MAS_CACHE_DIR is the models folder
    there), one folder per pair of pinned versions."""
    models = os.environ.get("MAS_CACHE_DIR")
    root = Path(models).parent if models else Path.home() / ".cache" / "mlx-actor-serve"
    name = "+".join(p.rsplit("/", 1)[1] for p in (CLAUDE_CODE, CODEX))  # claude-code@...+codex@...
    return root / "agents" / name


def install(folder: Path | None = None, timeout: float = 600) -> Path:
    """The folder holding the `claude` and `codex` commands, installed first when absent (into a
    staging folder renamed into place, so an interrupted install is never reused). Raises
    AgentsUnavailable saying why not: npm missing, the install or the first run failing."""
    folder = folder or agents_dir()
    bin_dir = folder / "node_modules" / ".bin"
    if (bin_dir / "claude").exists() and (bin_dir / "codex").exists():
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        raise AgentsUnavailable("npm is not on PATH: cannot install the agent CLIs")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(staging),
                               CLAUDE_CODE, CODEX], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode:
            raise AgentsUnavailable(f"npm install {CLAUDE_CODE} {CODEX} failed (exit "
                                    f"{done.returncode}): {done.stderr.strip()[-1500:]}")
        for name in ("claude", "codex"):  # a platform without a prebuilt binary fails here
            ran = subprocess.run([staging / "node_modules" / ".bin" / name, "--version"],
                                 capture_output=True, text=True, timeout=60,
                                 stdin=subprocess.DEVNULL)
            if ran.returncode:
                raise AgentsUnavailable(f"`{name} --version` failed after the install (exit "
                                        f"{ran.returncode}): {(ran.stderr or ran.stdout)[-500:]}")
        try:
            staging.rename(folder)
        except OSError:  # another process installed it first
            if not (bin_dir / "claude").exists():
                raise
    except subprocess.TimeoutExpired as e:
        raise AgentsUnavailable(f"installing the agent CLIs took over {e.timeout} s") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return bin_dir


def why_not(folder: Path | None = None) -> str | None:
    """None when the CLIs are installed (installing them now if need be), else the reason."""
    try:
        install(folder)
    except AgentsUnavailable as e:
        return str(e)
    return None


@dataclass
class Turn:
    """One CLI run: its exit code, the model's answer as the CLI gave it, everything it
    printed, and how long it took."""
    code: int
    answer: str
    stdout: str = field(repr=False)
    stderr: str = field(repr=False)
    seconds: float
    report: dict = field(default_factory=dict, repr=False)  # claude's --output-format json


class _Session:
    """A conversation in a throwaway root: root/home (HOME) and root/work (the working
    folder). A context manager; closing removes the root."""

    def __init__(self, bin_dir: Path, base_url: str, model: str):
        self.bin_dir, self.base_url, self.model = bin_dir, base_url.rstrip("/"), model
        self.root = Path(tempfile.mkdtemp(prefix="mas-agent-"))
        self.home, self.cwd = self.root / "home", self.root / "work"
        self.home.mkdir()
        self.cwd.mkdir()
        self.turns: list[Turn] = []

    def env(self) -> dict[str, str]:
        """Only what the CLI needs from this process's environment: none of the user's
        ANTHROPIC_*, OPENAI_*, CLAUDE_* or CODEX_* settings."""
        kept = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
        return {**kept, "HOME": str(self.home)}

    def _run(self, args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        done = subprocess.run(args, cwd=self.cwd, env=self.env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        return done, time.monotonic() - t0

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ClaudeSession(_Session):
    """Claude Code against base_url: the first ask is `claude -p PROMPT`, later ones
    `claude -p --continue PROMPT` (the same HOME and cwd, so it finds the conversation)."""

    def env(self) -> dict[str, str]:
        return {**super().env(), "ANTHROPIC_BASE_URL": self.base_url,
                "ANTHROPIC_API_KEY": "sk-mas-test", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}

    def ask(self, prompt: str, timeout: float = 300) -> Turn:
        more = ["--continue"] if self.turns else []
        done, seconds = self._run([str(self.bin_dir / "claude"), "-p", *more, "--model",
                                   self.model, "--output-format", "json", prompt], timeout)
        try:
            report = json.loads(done.stdout)
        except ValueError:
            report = {}
        turn = Turn(done.returncode, str(report.get("result", "")), done.stdout, done.stderr,
                    seconds, report)
        self.turns.append(turn)
        return turn


class CodexSession(_Session):
    """Codex against base_url (a provider "mas" speaking /v1/responses): the first ask is
    `codex exec PROMPT`, later ones `codex exec resume --last PROMPT`; CODEX_HOME is HOME."""

    def __init__(self, bin_dir: Path, base_url: str, model: str):
        super().__init__(bin_dir, base_url, model)
        (self.home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "mas"\n\n[model_providers.mas]\nname = "mas"\n'
            f'base_url = "{self.base_url}/v1"\nwire_api = "responses"\nenv_key = "MAS_API_KEY"\n')

    def env(self) -> dict[str, str]:
        return {**super().env(), "CODEX_HOME": str(self.home), "MAS_API_KEY": "sk-mas-test"}

    def ask(self, prompt: str, timeout: float = 300) -> Turn:
        last = self.root / f"answer-{len(self.turns) + 1}.txt"  # the final message, exactly
        more = ["resume", "--last"] if self.turns else []
        done, seconds = self._run([str(self.bin_dir / "codex"), "exec", *more,
                                   "--skip-git-repo-check", "-o", str(last), prompt], timeout)
        answer = last.read_text() if last.exists() else ""
        turn = Turn(done.returncode, answer, done.stdout, done.stderr, seconds)
        self.turns.append(turn)
        return turn
