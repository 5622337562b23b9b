"""Ray Tune's storage for a sweep without a shared disk: trial checkpoints live in a Ray actor.

Ray Tune persists a trial's checkpoints from the worker that reports them, into its
`RunConfig(storage_path)`: a local `--out` folder would be written (and, on a retry, read) by
every node, which needs a shared disk. `tune_filesystem` gives Tune a pyarrow filesystem
(`RunConfig(storage_filesystem=...)`, public Ray and pyarrow APIs) that routes by who asks:

- the driver process reads and writes the experiment's own state (what `Tuner.restore` reads
  back) in `--out/tune` on its disk, as with a local path;
- trial checkpoints (`.../checkpoint_NNNNNN/...`) and Tune's storage marker, and everything a
  process other than the driver touches, go to `TuneFiles`, a named actor pinned to the driver's
  node that keeps those few files in memory (a sweep's checkpoint is the list of keys a task has
  reported, sweep/worker.py).

So a worker never opens a path under `--out`. The checkpoints die with the driver: a resumed
sweep skips what its ledger holds instead (sweep/worker.py `ctx["done"]`).
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import socket
from typing import Any

import pyarrow as pa
from pyarrow import fs as pafs

log = logging.getLogger(__name__)

NOT_FOUND, FILE, DIR = 0, 1, 2
_TYPES = {NOT_FOUND: pafs.FileType.NotFound, FILE: pafs.FileType.File, DIR: pafs.FileType.Directory}
_CURRENT: tuple[str, tuple[str, int]] | None = None  # this driver's (actor name, driver id), once made
MARKER = ".validate_storage_marker"  # Tune's storage check (ray.train._internal.storage)


class TuneFiles:
    """The Ray actor: a tree of small files in memory (paths are posix, absolute)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/"}

    def _kind(self, path: str) -> int:
        return FILE if path in self.files else DIR if path in self.dirs else NOT_FOUND

    def info(self, paths: list[str]) -> list[tuple[int, int]]:
        return [(self._kind(p), len(self.files.get(p, b""))) for p in paths]

    def listing(self, base: str, recursive: bool) -> list[tuple[str, int, int]] | None:
        if base not in self.dirs:
            return None
        pre = base.rstrip("/") + "/"
        out = []
        for p in list(self.dirs) + list(self.files):
            if p.startswith(pre) and p != base and (recursive or "/" not in p[len(pre):]):
                out.append((p, self._kind(p), len(self.files.get(p, b""))))
        return sorted(out)

    def mkdir(self, path: str) -> None:
        while path not in self.dirs:
            self.dirs.add(path)
            path = posixpath.dirname(path)

    def put(self, path: str, data: bytes) -> None:
        self.mkdir(posixpath.dirname(path))
        self.files[path] = data

    def get(self, path: str) -> bytes | None:
        return self.files.get(path)

    def delete(self, path: str, what: str) -> int:
        """what: file | dir | contents; the number of entries removed."""
        pre = path.rstrip("/") + "/"
        gone = [p for p in list(self.files) + list(self.dirs) if p.startswith(pre)]
        if what == "file":
            gone = [path] if path in self.files else []
        elif what == "dir" and path in self.dirs:
            gone.append(path)
        for p in gone:
            self.files.pop(p, None)
            self.dirs.discard(p)
        return len(gone)

    def copy(self, src: str, dst: str, move: bool) -> bool:
        if src in self.files:
            self.put(dst, self.files[src])
            if move:
                del self.files[src]
            return True
        if src not in self.dirs:
            return False
        pre = src.rstrip("/") + "/"
        self.mkdir(dst)
        for p in [p for p in self.dirs if p.startswith(pre)]:
            self.mkdir(dst + p[len(src):])
        for p in [p for p in self.files if p.startswith(pre)]:
            self.put(dst + p[len(src):], self.files[p])
        if move:
            self.delete(src, "dir")
        return True


class _Upload(io.BytesIO):
    """An output stream whose bytes go to the actor when it is closed."""

    def __init__(self, store: Any, path: str, initial: bytes = b"") -> None:
        super().__init__()
        self.write(initial)
        self._store, self._path = store, path

    def close(self) -> None:
        if not self.closed:
            import ray

            ray.get(self._store.put.remote(self._path, self.getvalue()))
        super().close()


class RoutedHandler(pafs.FileSystemHandler):
    """pyarrow filesystem handler: the driver's own experiment state on its disk, the rest in `TuneFiles`."""

    def __init__(self, actor_name: str, driver: tuple[str, int]) -> None:
        self.actor_name, self.driver = actor_name, tuple(driver)
        self._store = None
        self._local = pafs.LocalFileSystem()

    def __getstate__(self) -> dict[str, Any]:
        return {"actor_name": self.actor_name, "driver": self.driver}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A resumed sweep's Tune restores its trials with the killed driver's handler (its actor and
        # pid are gone): in the driver that made a filesystem since, they take the current one.
        if _CURRENT is not None and state["actor_name"] != _CURRENT[0]:
            state = {"actor_name": _CURRENT[0], "driver": _CURRENT[1]}
        self.__init__(state["actor_name"], state["driver"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoutedHandler) and (other.actor_name, other.driver) == (self.actor_name, self.driver)

    def __hash__(self) -> int:
        return hash((self.actor_name, self.driver))

    # -- routing
    def in_driver(self) -> bool:
        return (socket.gethostname(), os.getpid()) == self.driver

    def remote(self, path: str) -> bool:
        parts = path.split("/")
        return (not self.in_driver() or parts[-1] == MARKER
                or any(p.startswith("checkpoint_") for p in parts))

    @property
    def store(self) -> Any:
        if self._store is None:
            import ray

            self._store = ray.get_actor(self.actor_name)
        return self._store

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.store, method).remote(*args))

    # -- the FileSystemHandler interface
    def get_type_name(self) -> str:
        return "expertsweep-routed"

    def equals(self, other: Any) -> bool:
        return self == getattr(other, "handler", other)

    def normalize_path(self, path: str) -> str:
        return posixpath.normpath(path) if path else path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        out: list[pafs.FileInfo | None] = [None] * len(paths)
        far = [i for i, p in enumerate(paths) if self.remote(p)]
        near = [i for i in range(len(paths)) if i not in set(far)]
        for i, info in zip(near, self._local.get_file_info([paths[i] for i in near]) if near else [], strict=True):
            out[i] = info
        if far:
            for i, (kind, size) in zip(far, self._call("info", [paths[i] for i in far]), strict=True):
                out[i] = pafs.FileInfo(paths[i], _TYPES[kind], size=size if kind == FILE else None)
        return out  # type: ignore[return-value]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        base = self.normalize_path(selector.base_dir)
        found: list[pafs.FileInfo] = []
        local_ok = False
        if not self.remote(base):
            try:
                found = self._local.get_file_info(pafs.FileSelector(base, allow_not_found=True,
                                                                    recursive=selector.recursive))
                local_ok = self._local.get_file_info(base).type == pafs.FileType.Directory
            except OSError:
                found = []
        listed = self._call("listing", base, selector.recursive)
        if listed is None and not local_ok and not selector.allow_not_found:
            raise FileNotFoundError(f"{base}: no such directory")
        names = {f.path for f in found}
        found += [pafs.FileInfo(p, _TYPES[k], size=s if k == FILE else None) for p, k, s in (listed or [])
                  if p not in names]
        return found

    def create_dir(self, path: str, recursive: bool) -> None:
        if self.remote(path):
            self._call("mkdir", path)
        else:
            self._local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        if self.remote(path):
            self._call("delete", path, "dir")
        else:
            self._local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        if self.remote(path):
            self._call("delete", path, "contents")
        else:
            self._local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("expertsweep's Tune storage refuses to delete the root")

    def delete_file(self, path: str) -> None:
        if self.remote(path):
            self._call("delete", path, "file")
        else:
            self._local.delete_file(path)

    def _transfer(self, src: str, dest: str, move: bool) -> None:
        r_src, r_dest = self.remote(src), self.remote(dest)
        if not r_src and not r_dest:
            (self._local.move if move else self._local.copy_file)(src, dest)
        elif r_src and r_dest:
            if not self._call("copy", src, dest, move):
                raise FileNotFoundError(src)
        else:  # between the driver's disk and the actor: files only (Tune moves none across)
            with self.open_input_stream(src) as f:
                data = f.read()
            with self.open_output_stream(dest, None) as g:
                g.write(data)
            if move:
                self.delete_file(src)

    def move(self, src: str, dest: str) -> None:
        self._transfer(src, dest, True)

    def copy_file(self, src: str, dest: str) -> None:
        self._transfer(src, dest, False)

    def _read(self, path: str) -> pa.NativeFile:
        data = self._call("get", path)
        if data is None:
            raise FileNotFoundError(path)
        return pa.BufferReader(data)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self._read(path) if self.remote(path) else self._local.open_input_stream(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        return self._read(path) if self.remote(path) else self._local.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        if not self.remote(path):
            return self._local.open_output_stream(path, metadata=metadata)
        return pa.PythonFile(_Upload(self.store, path), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        if not self.remote(path):
            return self._local.open_append_stream(path, metadata=metadata)
        return pa.PythonFile(_Upload(self.store, path, self._call("get", path) or b""), mode="w")


def tune_filesystem(name: str, driver_node: str) -> tuple[pafs.PyFileSystem, Any]:
    """In the driver: start the `TuneFiles` actor `name` on the driver's node and return
    (the filesystem to give Tune, the actor handle, to kill when the sweep ends)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(TuneFiles).options(
        name=name, num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=False)).remote()
    ray.get(actor.info.remote([]))  # up before Tune asks
    global _CURRENT
    _CURRENT = (name, (socket.gethostname(), os.getpid()))
    return pafs.PyFileSystem(RoutedHandler(*_CURRENT)), actor
