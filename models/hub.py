"""Models named the way the Hugging Face hub names them: `org/name`, optionally `org/name@rev`.

`model.path` is a local directory or a repo id. A repo id is looked up with huggingface_hub
(what mlx-lm downloads with), in its cache first (HF_HOME / HF_HUB_CACHE, read by the library),
then downloaded when the hub is reachable, with the library's progress bars, before any actor
starts. Offline (HF_HUB_OFFLINE=1, or no network) a cached model serves and an uncached one
fails at launch with an error naming the repo, the cache folder looked in and the command
that downloads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# What serving needs from a repo: config, weights, tokenizer and chat template files.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken",
               "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


class ModelNotFound(ValueError):
    """A repo id that is neither cached nor downloadable here."""


@dataclass(frozen=True)
class Resolved:
    folder: Path  # the snapshot folder the actors load
    repo_id: str
    revision: str  # the commit the folder holds


def split_revision(spec: str, revision: str = "") -> tuple[str, str]:
    """("org/name", "rev") from "org/name@rev"; `revision` (model.revision) where the spec
    names none. ValueError when both name one and they differ."""
    repo, at, rev = spec.partition("@")
    if at and revision and rev != revision:
        raise ValueError(f"model.path {spec!r} names revision {rev!r} but model.revision is "
                         f"{revision!r}")
    return repo, rev or revision


def is_repo_id(spec: str) -> bool:
    """`org/name` or `org/name@rev`, as the hub spells repo ids (a path like ./x/y or ~/x/y, or
    one with more than one slash, is not)."""
    return bool(_REPO_ID.match(spec.partition("@")[0])) and not spec.startswith(".")


def cache_folder() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve(spec: str, revision: str = "") -> Resolved:
    """The local folder of repo `spec` (org/name[@rev]) at `revision` (default: main): from the
    cache, else downloaded. ModelNotFound, naming the repo, the cache folder and the download
    command, when neither works."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo, rev = split_revision(spec, revision)
    try:
        folder = snapshot_download(repo, revision=rev or None, local_files_only=True)
    except LocalEntryNotFoundError:
        folder = None
    if folder is None:
        where = f"{repo}@{rev}" if rev else repo
        command = f"hf download {repo}" + (f" --revision {rev}" if rev else "")
        not_here = (f"model {where} is not in the Hugging Face cache ({cache_folder()}); "
                    f"download it with `{command}`")
        if _offline():
            raise ModelNotFound(f"{not_here} (HF_HUB_OFFLINE is set: nothing is downloaded)")
        try:
            folder = snapshot_download(repo, revision=rev or None, allow_patterns=MODEL_FILES)
        except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
            raise ModelNotFound(f"{not_here}; the hub refused it: {type(e).__name__}") from None
        except (LocalEntryNotFoundError, OSError) as e:  # no network, hub down
            raise ModelNotFound(f"{not_here}; the hub could not be reached "
                                f"({type(e).__name__})") from None
    path = Path(folder)
    return Resolved(folder=path, repo_id=repo, revision=path.name)
