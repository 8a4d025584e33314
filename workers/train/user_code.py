"""The user's own code: resolve ``pkg.module:function`` references, call them, and say in one line what went
wrong (``mylab/models.py:88: NameError: name 'undefined_name' is not defined``).

Where the code comes from: on the cluster, the job's uploaded package is the Ray job's ``working_dir`` (Ray
unpacks it on each node and puts it first on ``sys.path`` of the driver and of every worker); ``tlab run --local
--code DIR`` puts DIR there (``add_code_dir``). A factory may also name an installed module.

Every failure inside the user's code becomes a ``UserCodeError``: its message is the one line (the innermost
traceback frame inside the user's package, else the line of the function's definition, then the error), and it
keeps the full traceback (``traceback_text``) for the job's log. It is a ValueError, so a retry from a checkpoint
(which would only repeat it) is not attempted.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from workers.train.failure import is_internal, shown_path

_CODE_DIRS: list[Path] = []  # directories added with add_code_dir: frames under them are the user's


class UserCodeError(ValueError):
    """The user's code failed: the message is one line naming their file and line; ``traceback_text`` is all."""

    def __init__(self, line: str, traceback_text: str = "") -> None:
        super().__init__(line)
        self.traceback_text = traceback_text


def add_code_dir(path: str | Path) -> Path:
    """Put DIR first on ``sys.path`` (``tlab run --code DIR``); frames under it count as the user's."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"--code {path}: no such directory (give the directory holding your package)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if root not in _CODE_DIRS:
        _CODE_DIRS.append(root)
    return root


def _display(path: str) -> str:
    """A user's file as they know it: relative to the --code directory or the Ray package it lies in."""
    p = Path(path)
    for root in _CODE_DIRS:
        if p.is_relative_to(root):
            return str(p.relative_to(root))
    return shown_path(path)


def _is_users(path: str) -> bool:
    p = Path(path)
    return any(p.is_relative_to(root) for root in _CODE_DIRS) or not is_internal(path)


def where_in_user_code(tb: TracebackType | None) -> str | None:
    """``file:line`` of the innermost traceback frame inside the user's code (None when it never got there)."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if _is_users(frame.filename):
            return f"{_display(frame.filename)}:{frame.lineno}"
    return None


def describe(err: BaseException, fallback: str | None = None) -> tuple[str | None, str]:
    """(``file:line`` or None, ``Type: message``) for ``err`` raised from the user's code: a SyntaxError names
    the line it is on; an error that never reached their code (a missing module) is placed at ``fallback``."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else "(no message)"
    where = None
    if isinstance(err, SyntaxError) and err.filename:
        where = f"{_display(err.filename)}:{err.lineno}"
        message = err.msg
    return where or where_in_user_code(err.__traceback__) or fallback, f"{type(err).__name__}: {message}"


def one_line(err: BaseException, fallback: str | None = None) -> str:
    """``mylab/models.py:88: NameError: name 'x' is not defined`` (no place when none is known)."""
    where, text = describe(err, fallback)
    return f"{where}: {text}" if where else text


def _failed(err: BaseException, field: str, ref: str, fallback: str | None = None) -> UserCodeError:
    full = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    where, text = describe(err, fallback)
    return UserCodeError(f"{where}: {text}" if where else f"{field} {ref}: {text}", full)


def resolve(ref: str, field: str) -> Callable[..., Any]:
    """The function ``ref`` (``pkg.module:function``) names; UserCodeError naming ``field`` if it cannot be had."""
    module_name, _, attr_path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):  # the module itself (or its package) is not there
            raise UserCodeError(f"{field} {ref}: no module named {err.name!r}: upload the package that holds it "
                                "(tlab submit --code DIR) or fix the module path") from None
        raise _failed(err, field, ref) from err
    except Exception as err:  # SyntaxError, NameError, ImportError inside their module: their file and line
        raise _failed(err, field, ref) from err
    for name in attr_path.split("."):
        if not hasattr(obj, name):
            where = getattr(obj, "__file__", None) or getattr(obj, "__name__", "")
            raise UserCodeError(f"{field} {ref}: {_display(str(where))} has no {name!r}: check the function's name")
        obj = getattr(obj, name)
    if not callable(obj):
        raise UserCodeError(f"{field} {ref}: {type(obj).__name__} is not callable: name a function")
    return obj


def definition(fn: Callable[..., Any]) -> str | None:
    """``file:line`` of the function's ``def``, for errors about how it is called."""
    try:
        target = inspect.unwrap(fn)
        return f"{_display(inspect.getsourcefile(target) or '')}:{inspect.getsourcelines(target)[1]}"
    except (OSError, TypeError):
        return None


def call(ref: str, field: str, args: dict[str, Any]) -> Any:
    """``ref(**args)``: an unknown or missing argument is refused before the call (naming ``field``'s args and the
    function's ``def`` line), and any error raised inside becomes a UserCodeError with their file and line."""
    fn = resolve(ref, field)
    args_field = f"{field.rsplit('.', 1)[0]}.args"
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as err:
        where = definition(fn)
        text = f"TypeError: {ref} does not take these {args_field} ({err}): change {args_field} or the signature"
        raise UserCodeError(f"{where}: {text}" if where else text) from None
    except ValueError:  # no signature to read (a builtin): let the call say
        pass
    try:
        return fn(**args)
    except UserCodeError:
        raise
    except Exception as err:
        raise _failed(err, field, ref, fallback=definition(fn)) from err


def report(sink: Any, err: UserCodeError) -> None:
    """The full traceback as a ``log`` event of the job (the one line is the failure's reason, said elsewhere)."""
    if err.traceback_text:
        sink.emit({"kind": "log", "level": "info", "message": f"traceback of: {err}",
                   "traceback": err.traceback_text})
        flush = getattr(sink, "flush", None)
        if callable(flush):
            flush()
