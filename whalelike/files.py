"""Writing output files: every file of a command, or none, each checked before any work is done.

Every writer in whalelike (the CLI, ``Plan.to_yaml``, the timeline pictures and traces) goes
through this module, so they share one behaviour instead of several copies of
temp-file-then-``os.replace`` that differed in permissions and in what they left behind.

Invariant: a target path either keeps its old content or gets the complete new content; a
command's targets change together (all or none); no temporary file survives a failure; a file
that is written gets the mode ``open(path, "w")`` would give it (an existing file keeps its
mode, a new one gets ``0o666 & ~umask``).

How:

- :func:`check_output_paths` refuses, before any work, what would fail (or do harm) only at the
  final move: an empty path, a directory, a parent that is a file, a FIFO, device or socket, a
  read-only file, an unwritable directory, the wrong extension for the kind of file, and two
  outputs that name the same file. A missing parent directory is made (``mkdir -p``) when the
  file is staged, where its nearest existing ancestor is a writable directory, and removed again
  if the command fails before anything is written (``-o out/plan.yaml`` works before ``out/``
  exists, as users expect of an output option).
- :class:`Outputs` stages each target as a temporary file beside it (same directory, so the move
  is an atomic ``rename``), and at :meth:`Outputs.commit` checks every target again and sets every
  mode *before* the first rename; only then does it move the files. A rename that still fails
  after that (the disk vanished) is reported with the files that were already written.
- Symlinks are written *through*: the file the link points to gets the new content and the link
  stays a link (as ``open(link, "w")`` does). Replacing the link by a regular file would silently
  break whatever the link was for (a "latest.yaml" pointing into a results folder, say).
  Consequences: the temporary file lives in the link target's directory, and two outputs that
  resolve to the same file are refused as duplicates.
- Replacing a file by rename gives it a new inode: hard links to the old file keep the old
  content, and the new file is owned by the writing user. That is the price of atomicity (and
  what ``torch.save``-then-rename, editors and package managers do too).

Why not :func:`tempfile.mkstemp` plus :func:`os.replace` (what each writer did before): mkstemp
makes ``0o600`` files, and undoing that needs the umask, which can only be read by setting it
(racy with threads). Here the temporary file is created with ``os.open(..., 0o666)``, so the
kernel applies the umask exactly as for ``open(path, "w")``.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import yaml

from whalelike.errors import WhaleError

PathLike = Union[str, "os.PathLike[str]"]

# kind -> (accepted extensions, what the file is); the first extension is the one suggested
KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    "yaml": ((".yaml", ".yml"), "a YAML file"),
    "png": ((".png",), "a PNG picture"),
    "json": ((".json",), "a JSON file"),
    "jsonl": ((".jsonl",), "a JSON-lines file"),
}
TEMP_MARK = ".tmp"
_NEW_FILE_MODE = 0o666  # before the umask, as open(path, "w")


class OutputError(WhaleError):
    """An output file cannot be written where the user asked (bad path, kind, or a failed move)."""


def check_output_paths(paths: Mapping[str, Optional[PathLike]],
                       kinds: Optional[Mapping[str, Optional[str]]] = None,
                       inputs: Optional[Mapping[str, Optional[PathLike]]] = None) -> None:
    """Refuse bad output paths before any work: ``paths`` maps an option label (``"-o"``,
    ``"--timeline"``) to its path (None = option not given, skipped); ``kinds`` optionally maps a
    label to the kind of file it gets (``"yaml"``, ``"png"``, ``"json"``) to check the extension;
    ``inputs`` optionally maps labels to the files the command reads, which no output may replace.

    Raises :class:`OutputError` naming the option, the path and the fix.
    """
    kinds = kinds or {}
    read = {os.path.realpath(path): label for label, path in (inputs or {}).items()
            if path is not None and os.fspath(path) and os.path.isfile(path)}
    seen: dict[str, str] = {}  # real path -> label
    for label, path in paths.items():
        if path is None:
            continue
        real = _check_target(label, path, kinds.get(label))
        if real in seen:
            raise OutputError(_same_file(seen[real], label, path))
        if real in read:
            raise OutputError(f"{label} {os.fspath(path)}: is the {read[real]} input of this command; writing "
                              "there would replace it, choose another path")
        seen[real] = label


def write_atomic(path: PathLike, data: Union[bytes, str], kind: Optional[str] = None) -> None:
    """Write ``data`` (str is encoded as UTF-8) to ``path`` atomically (see the module docstring)."""
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    with Outputs() as out:
        with open(out.stage(path, kind), "wb") as f:
            f.write(payload)


class Outputs:
    """The files of one command, written all or none.

    ::

        with Outputs() as out:
            tmp = out.stage("plan.yaml", kind="yaml", label="-o")   # checks the path now
            ...                                                    # the work, then write tmp
        # leaving the block normally commits; an exception removes every temporary file

    :meth:`commit` may also be called inside the block (it returns the targets written; a second
    call does nothing), and :meth:`discard` to give up. The temporary path ends with the target's
    extension, so a writer that checks the kind accepts it.
    """

    def __init__(self) -> None:
        self._staged: list[_Staged] = []
        self._made: list[str] = []      # directories made for the targets (outermost first), removed on discard
        self._finished = False          # committed or discarded: no more staging or moving
        self._written: list[str] = []   # targets moved into place

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.commit()

    def stage(self, target: PathLike, kind: Optional[str] = None, *, label: Optional[str] = None) -> str:
        """Check ``target`` (as :func:`check_output_paths`, and against the targets staged so far)
        and return a new, empty temporary file beside it to write the content to."""
        if self._finished:
            raise RuntimeError("Outputs.stage after commit or discard: use a new Outputs for more files")
        label = label or "output file"
        real = _check_target(label, target, kind)
        for earlier in self._staged:
            if earlier.real == real:
                raise OutputError(_same_file(earlier.label, label, target))
        folder = os.path.dirname(real)
        if not os.path.exists(folder):
            self._made += _make_folder(label, target, folder)
        temp, new_mode = _create_temp(label, target, real)
        self._staged.append(_Staged(os.fspath(target), real, temp, label, kind, new_mode))
        return temp

    def commit(self) -> list[str]:
        """Move every staged file into place and return the targets (as given). Every target is
        checked again and every mode set before the first move; on failure no temporary file is
        left and :class:`OutputError` says what was written, if anything."""
        if self._finished:
            return list(self._written)
        self._finished = True
        try:
            for s in self._staged:
                if _check_target(s.label, s.target, s.kind) != s.real:
                    raise OutputError(f"{s.label} {s.target}: the path changed (a symlink was replaced) while "
                                      "the files were being made; nothing was written, run the command again")
                # an existing file keeps its mode, a new one gets open()'s (the writer may have
                # replaced the temporary file by one of its own, with other permissions)
                existing = os.path.exists(s.real)
                os.chmod(s.temp, stat.S_IMODE(os.stat(s.real).st_mode) if existing else s.new_mode)
                flush_to_disk(s.temp)
        except BaseException:
            self.discard()
            raise
        written = self._written
        for index, s in enumerate(self._staged):
            try:
                os.replace(s.temp, s.real)
            except BaseException as e:  # Ctrl-C included: no temporary file may survive
                self._discard(self._staged[index:])
                if not isinstance(e, OSError):
                    raise
                done = f"already written: {', '.join(written)}" if written else "no file was written"
                raise OutputError(f"{s.label} {s.target}: moving the finished file into place failed "
                                  f"({e.strerror or e}); {done}") from e
            written.append(s.target)
        for folder in {os.path.dirname(s.real) for s in self._staged}:
            flush_to_disk(folder)
        return list(written)

    def discard(self) -> None:
        """Remove every temporary file not yet moved into place (the targets are untouched), and the
        directories made for them that are still empty."""
        self._finished = True
        self._discard(self._staged)
        _remove_folders(self._made)

    @staticmethod
    def _discard(staged: list["_Staged"]) -> None:
        for s in staged:
            with contextlib.suppress(FileNotFoundError):   # never created, or already moved
                os.unlink(s.temp)


@dataclass(frozen=True)
class _Staged:
    target: str           # as the caller gave it
    real: str             # symlinks resolved: the file that gets the content
    temp: str             # the temporary file beside ``real``
    label: str            # the option that named it, for messages
    kind: Optional[str]
    new_mode: int         # the mode open(path, "w") would give a new file there


# -- checks ----------------------------------------------------------------------------------------
def _check_target(label: str, path: PathLike, kind: Optional[str]) -> str:
    """The real path (symlinks resolved) that ``path`` writes to, or OutputError saying why not."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{label}: output paths are str or os.PathLike[str], got {type(text).__name__}")
    if not text.strip():
        raise OutputError(f"{label}: the output path is empty ({text!r}); give a file name"
                          f"{_example(label, '', kind)}")
    if "\0" in text:
        raise OutputError(f"{label} {text!r}: a path cannot contain a NUL character")
    if os.path.isdir(text):  # a symlink to a directory too
        raise OutputError(f"{label} {text}: is a directory; name a file inside it"
                          f"{_example(label, text, kind)}")
    if text.endswith(os.sep):
        raise OutputError(f"{label} {text}: ends with {os.sep!r}, so it names a directory; name a file"
                          f"{_example(label, text, kind)}")
    if kind is not None:
        _check_extension(label, text, kind)
    real = os.path.realpath(text)
    folder = os.path.dirname(real)
    existing = _existing_ancestor(folder)   # a missing folder is made when the file is staged (mkdir -p)
    if not os.path.isdir(existing):
        raise OutputError(f"{label} {text}: {existing} is not a directory; choose a path inside a directory")
    if existing != folder:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise OutputError(f"{label} {text}: directory {folder} does not exist and cannot be made in {existing} "
                              "(permission denied or a read-only file system); choose a writable directory")
        return real
    try:
        info = os.stat(real)
    except FileNotFoundError:
        info = None
    except OSError as e:  # a symlink loop, a path too long
        raise OutputError(f"{label} {text}: cannot be used as an output ({e.strerror}); choose another path") from e
    if info is not None:
        if not stat.S_ISREG(info.st_mode):
            raise OutputError(f"{label} {text}: is a {_file_type(info.st_mode)}, not a regular file; whalelike "
                              "writes only regular files, choose another path")
        if not os.access(real, os.W_OK):
            raise OutputError(f"{label} {text}: the existing file is read-only; make it writable "
                              f"(chmod u+w {text}) or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{label} {text}: cannot create files in {folder} (permission denied or a "
                          "read-only file system); choose a writable directory")
    return real


def _existing_ancestor(folder: str) -> str:
    """``folder`` if it exists, else its nearest ancestor that does (a file, when a component is one)."""
    while not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return folder


def _make_folder(label: str, target: PathLike, folder: str) -> list[str]:
    """Make ``folder`` and its missing parents; returns the directories made, outermost first."""
    made = []
    missing = folder
    while not os.path.exists(missing):
        made.append(missing)
        missing = os.path.dirname(missing)
    made.reverse()
    try:
        for path in made:
            os.mkdir(path)
    except OSError as e:
        _remove_folders(made)
        raise OutputError(f"{label} {os.fspath(target)}: cannot make directory {folder} ({e.strerror or e}); "
                          "choose a writable directory") from e
    return made


def _remove_folders(made: list[str]) -> None:
    """Remove the directories a command made (innermost first), where they are still empty."""
    for path in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _check_extension(label: str, text: str, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}; one of {', '.join(KINDS)}")
    extensions, what = KINDS[kind]
    stem, extension = os.path.splitext(text)
    if extension.lower() in extensions:
        return
    accepted = " or ".join(extensions)
    got = f"got {extension!r}" if extension else "it has no extension"
    raise OutputError(f"{label} {text}: expected {what} ending in {accepted}, {got}; "
                      f"use e.g. {stem or 'out'}{extensions[0]}")


def _same_file(first: str, second: str, path: PathLike) -> str:
    if first == second:
        return f"{first} {os.fspath(path)}: given twice as an output; each output needs its own file"
    return (f"{first} and {second} name the same file ({os.fspath(path)}); give each output its own file, "
            "or the second would overwrite the first")


def _example(label: str, folder: str, kind: Optional[str]) -> str:
    if kind is None:
        return ""
    name = {"yaml": "plan.yaml", "png": "timeline.png", "json": "trace.json"}[kind]
    return f", e.g. {label} {os.path.join(folder, name)}"


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


# -- temporary files -------------------------------------------------------------------------------
def _create_temp(label: str, target: PathLike, real: str) -> tuple[str, int]:
    """A new empty file beside ``real``, named ``.<stem>.<random>.tmp<ext>`` (hidden, same extension),
    and the mode a new file gets there: it is created with 0o666, so the kernel applies the umask
    (and a default ACL) exactly as for ``open(path, "w")``."""
    folder, name = os.path.split(real)
    stem, extension = os.path.splitext(name)
    stem = stem[:64]  # a long target name plus the marks must stay a legal name
    for _ in range(100):
        temp = os.path.join(folder, f".{stem}.{secrets.token_hex(4)}{TEMP_MARK}{extension}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                         _NEW_FILE_MODE)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                reason, fix = "permission denied", "choose a writable directory"
            else:
                reason, fix = e.strerror or str(e), "choose another path"
            raise OutputError(f"{label} {os.fspath(target)}: cannot create a file in {folder} ({reason}); "
                              f"{fix}") from e
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0o666 & ~umask, read without touching the umask
        finally:
            os.close(fd)
        return temp, mode
    raise OutputError(f"{label} {os.fspath(target)}: could not pick an unused temporary name in {folder}")


def flush_to_disk(path: PathLike) -> None:
    """fsync a finished file (or a directory after renames), so a crash cannot leave an empty
    target behind a completed rename; file systems that cannot fsync a directory are skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):   # e.g. a directory on a file system without dir fsync
            os.fsync(fd)
    finally:
        os.close(fd)


class LineLog:
    """An append-only log of whole lines (a JSON-lines metrics file): the path checked as any output
    when opened (:func:`check_output_paths`), each :meth:`write` one complete line flushed at once, so
    a reader (or a run killed between steps) never sees half a line. A log grows while a run goes,
    so it cannot be all-or-none like the other outputs; it is the one writer here that appends.
    ``label``: what the path came from, for errors (``"--metrics"``)."""

    def __init__(self, path: PathLike, kind: str = "jsonl", label: str = "log", append: bool = False):
        check_output_paths({label: path}, kinds={label: kind})
        self.path = os.fspath(path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, line: str) -> None:
        if "\n" in line:
            raise ValueError("LineLog.write takes one line, without a newline in it")
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def write_yaml(path: PathLike, data: object, header: str = "") -> None:
    """Write plain ``data`` (dicts, lists, numbers, strings) to ``path`` as YAML, atomically
    (:func:`write_atomic`, kind ``yaml``): mappings in block style and lists of plain values inline
    (``[0.012, 0.025]``), keys in the order given; ``header`` becomes ``#`` comment lines on top.
    The profile (:mod:`planner.devices.profile`) and its cache entries are written through it."""
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    write_atomic(path, comment + yaml.safe_dump(data, sort_keys=False, default_flow_style=None), kind="yaml")
