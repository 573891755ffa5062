"""huggingface_hub's progress bars, replaced: a download counts its bytes into the step's meter and draws nothing.

snapshot_download makes every bar of a download with the `tqdm_class` it is given (huggingface_hub 2.4.0,
_snapshot_download.py `snapshot_download`): the network bar "Downloading bytes", the bar of bytes written
"Reconstructing (incomplete total...)", and hf_thread_map's bar of files (utils/tqdm.py `hf_thread_map`). Each file's
bytes reach the bar of bytes written through its `_AggregatedTqdm`: `update(n)` for each chunk written
(file_download.py `http_get`), `update(initial)` for the part of a resumed download already on disk, `update(-n)` when
a resume must start over. A class that is not huggingface_hub's own tqdm is called with the bar's keyword arguments
and nothing else (utils/tqdm.py `_create_progress_bar`): no `disable`, no `name`, no TTY check, so nothing is drawn but
what it draws, here nothing. (HF_HUB_DISABLE_PROGRESS_BARS or utils.disable_progress_bars would hide the bars too, but
then no bar counts anything.)

The total is known before the first bar is made: snapshot_download first writes the commit's file listing into the
cache (`<repo>/trees/<commit>.json`, _tree_cache.py), and a file is downloaded only where the patterns allow it
(utils.filter_repo_objects, as snapshot_download filters) and the cache lacks its blob, named by the file's ETag: the
LFS sha256 or the git blob sha1 (file_download.py `_hf_hub_download_to_cache_dir` links a blob that is there).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from qbuild.core.progress import Meter

BYTES_WRITTEN = "Reconstructing"     # the start of the description of snapshot_download's bar of bytes written


class HubBars:
    """The tqdm_class of one snapshot_download of `commit` into the cache folder `repo_dir` (hf.hf_repo_dir):
    `open_meter(total)` opens the meter of the download at its first byte bar, if any byte is to come."""

    def __init__(self, open_meter: Callable[[float | None], Meter] | None, repo_dir: Path, commit: str,
                 patterns: tuple[str, ...]):
        self._open_meter, self._repo_dir, self._commit, self._patterns = open_meter, repo_dir, commit, patterns
        self._meter: Meter | None = None
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs) -> Bar:
        counting = kwargs.get("unit") == "B" and str(kwargs.get("desc", "")).startswith(BYTES_WRITTEN)
        return Bar(self._counting_meter() if counting else None, **kwargs)

    def _counting_meter(self) -> Meter | None:
        with self._lock:
            if self._meter is None and self._open_meter is not None:
                total = self.bytes_to_download()
                if total != 0:
                    self._meter = self._open_meter(total)
            return self._meter

    def bytes_to_download(self) -> int | None:
        """Bytes of the files the download will fetch, from the commit's cached listing; None where it cannot be
        read (a listing huggingface_hub could not write: the count then goes without a total)."""
        from huggingface_hub.utils import filter_repo_objects

        try:
            listing = json.loads((self._repo_dir / "trees" / f"{self._commit}.json").read_text())["files"]
            wanted = filter_repo_objects(listing, allow_patterns=list(self._patterns))
            return sum(int(listing[name]["size"]) for name in wanted
                       if not (self._repo_dir / "blobs" / (listing[name].get("lfs_sha256") or
                                                           listing[name]["blob_id"])).exists())
        except (OSError, ValueError, KeyError, TypeError):
            return None


class Bar:
    """What huggingface_hub calls on a bar (tqdm's surface as snapshot_download, http_get and hf_thread_map use it),
    counting into a meter (or nothing) and drawing nothing."""

    def __init__(self, meter: Meter | None = None, *args, total: float | None = None, initial: float = 0,
                 desc: str | None = None, **kwargs):
        self._meter = meter
        self.total, self.n, self.desc = total, 0, desc or ""
        if initial:
            self.update(initial)

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0
        if self._meter is not None and n:
            self._meter.advance(n)

    @property
    def format_dict(self) -> dict:
        return {"n": self.n, "total": self.total, "rate": None, "elapsed": 0}

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    set_description_str = set_description

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def refresh(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        pass
