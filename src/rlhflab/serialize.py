"""How rlhflab writes files: secrets redacted, no NaN / Infinity in JSON, atomic replacement.

    redact(text) / redact_obj(obj)       secret environment values and secret-named keys -> '***'
    redacted_console()                   sys.stdout / sys.stderr redacted line by line (the CLI)
    to_json(obj)                         the one JSON serialiser (redacted, NaN / inf as null + note)
    encode_nonfinite / decode_nonfinite  exact round trip of NaN / inf (checkpoint state.json)
    write_{text,json,yaml}_atomic        temporary file beside the target, fsync, rename
    match_umask(path)                    files written 0600 by a library get the umask's mode

Nothing here knows about run directories (`rlhflab.rundir`) or checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Name parts that make a name (config key, environment variable) a secret's, when last:
#: HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, db_password, client_secret, task.config.token.
_SECRET_NOUNS = {"token", "secret", "password", "passwd", "credential", "credentials"}
_SECRET_NOUNS |= {"apikey", "passphrase", "auth", "authorization", "bearer", "cookie"}
#: "key" is a secret only after one of these ("eval_key", "sort_key", "answer_key" are not).
_KEY_QUALIFIERS = {"api", "access", "secret", "private", "auth", "signing", "encryption"}
_KEY_QUALIFIERS |= {"client", "license", "master", "session", "ssh", "gpg", "service"}
#: "token" after one of these names a tokenizer's special token ("pad_token: <pad>"), no secret.
_SPECIAL_TOKEN_ROLES = {"pad", "eos", "bos", "unk", "sep", "cls", "mask", "stop", "start", "end"}
_SPECIAL_TOKEN_ROLES |= {"special", "additional", "reward", "image", "chat", "think"}
#: Values that are flags, not secrets (HF_HUB_DISABLE_IMPLICIT_TOKEN=1): never searched for.
_FLAG_VALUES = {"", "0", "1", "true", "false", "yes", "no", "on", "off", "none", "null"}
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    """Whether a config key or environment variable name names a secret.

    The name is split into parts at '_', '-', '.', '/', spaces and lower-to-upper case changes,
    and the last part decides (the head noun of the compound): `token`, `secret`, `password`,
    `credential(s)`, `apikey`, `auth`... are secrets (`HF_TOKEN`, `client_secret`, `apiKey`);
    `key` only after `api`, `access`, `secret`, `private`... (`WANDB_API_KEY`, `access_key`, not
    `eval_key`); `token` not after a tokenizer role (`pad_token`, `eos_token`). Plural or longer
    words are other words: `max_new_tokens`, `tokenizer`, `stop_token_ids`,
    `TOKENIZERS_PARALLELISM` are not secrets.
    """
    parts = [p.lower() for p in re.split(r"[_\-./\s]+|(?<=[a-z0-9])(?=[A-Z])", str(name)) if p]
    if not parts:
        return False
    last, before = parts[-1], parts[-2] if len(parts) > 1 else ""
    if last == "key":
        return before in _KEY_QUALIFIERS
    if last == "token":
        return before not in _SPECIAL_TOKEN_ROLES
    return last in _SECRET_NOUNS


def secret_values() -> list[str]:
    """Values of environment variables named like secrets (`is_secret_name`), longest first.

    Any length counts (a 6-character token is still a secret); only flag-like values (`1`,
    `true`, `off`, empty...) are left out, since they cannot be secrets and would otherwise
    replace every '1' in every string.
    """
    values = {
        v
        for k, v in os.environ.items()
        if is_secret_name(k) and v.strip().lower() not in _FLAG_VALUES
    }
    return sorted(values, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every secret environment value replaced by '***'.

    For free text (error messages, console lines). Structured data (JSON, YAML) goes through
    `redact_obj` instead, which never touches numbers, keys or structure.
    """
    for secret in secret_values():
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON-like object (dicts, lists, tuples, scalars) with secrets replaced by
    '***' inside string values only; numbers, bools, None and dict keys are returned as they are.

    Two rules: (1) every secret environment value (`secret_values`) is replaced wherever it
    occurs inside a string; (2) every string or number under a dict key that names a secret
    (`is_secret_name`: `token`, `api_key`, `password`...) is replaced whole, whatever its
    length and whether or not it is in the environment (`task.config: {token: hf_abc123}`);
    bools and None under such a key stay (`use_auth_token: true` is not a secret).

    Everything written into a run directory (config, metrics, samples, results, checkpoint
    state) goes through this before serialisation, so a token that reached a config value or a
    prompt never lands on disk, while a secret made of digits that also occurs inside a logged
    number or an RNG state cannot corrupt the file.
    """
    secrets = secret_values()

    def walk(x: Any, under_secret: bool = False) -> Any:
        if isinstance(x, os.PathLike):
            x = os.fspath(x)
        if under_secret and isinstance(x, str | int | float) and not isinstance(x, bool):
            return REDACTED
        if isinstance(x, str):
            for secret in secrets:
                if secret in x:
                    x = x.replace(secret, REDACTED)
            return x
        if isinstance(x, dict):
            return {
                k: walk(v, under_secret or (isinstance(k, str) and is_secret_name(k)))
                for k, v in x.items()
            }
        if isinstance(x, list | tuple):
            return [walk(v, under_secret) for v in x]
        return x

    return walk(obj)


class RedactedStream:
    """A text stream that writes `redact(text)` to the stream it wraps, a line at a time.

    Text is held until a line ends (`\\n` or `\\r`, so progress bars redraw) or `flush()` is
    called, then redacted and written: a secret that reaches the stream in several `write` calls
    (`print` writes its text and its end separately) is still replaced whole. Every other
    attribute (`isatty`, `fileno`, `encoding`...) is the wrapped stream's.
    """

    def __init__(self, stream) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        """Hold `text`; write every complete line, redacted. Returns `len(text)`."""
        self._pending += text
        cut = max(self._pending.rfind("\n"), self._pending.rfind("\r"))
        if cut >= 0:
            done, self._pending = self._pending[: cut + 1], self._pending[cut + 1 :]
            self._stream.write(redact(done))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Write what is held (redacted), then flush the wrapped stream."""
        if self._pending:
            text, self._pending = self._pending, ""
            self._stream.write(redact(text))
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacted_console() -> Iterator[None]:
    """For the life of the block, `sys.stdout` and `sys.stderr` are `RedactedStream`s: every line
    printed (results, summaries, hints, errors, progress, warnings, tracebacks) has the secret
    environment values (`secret_values`) replaced by '***', as in the files a run writes. The
    original streams are restored (and what is held flushed) on exit. Streams that are None
    (no console) or already redacted are left as they are."""
    saved = sys.stdout, sys.stderr
    if sys.stdout is not None and not isinstance(sys.stdout, RedactedStream):
        sys.stdout = RedactedStream(sys.stdout)
    if sys.stderr is not None and not isinstance(sys.stderr, RedactedStream):
        sys.stderr = RedactedStream(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, RedactedStream):
                with contextlib.suppress(Exception):  # a closed stream: nothing left to write
                    stream.flush()
        sys.stdout, sys.stderr = saved


#: Why a value is null, written beside it (`<key>_note`) where the value was NaN or ±inf.
NONFINITE_NOTES = {
    "nan": "undefined (NaN): nothing to compute it from, e.g. a mean, accuracy or standard error "
    "over too few items, an AUC with one class absent, or a non-finite loss",
    "inf": "infinite (+inf): the value overflowed or divided by zero",
    "-inf": "infinite (-inf): the value overflowed or divided by zero",
}


def _nonfinite_kind(x: Any) -> str | None:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    return None


def finite_json(obj: Any) -> Any:
    """A copy of a JSON-like object in which no float is NaN or ±inf: each such value becomes
    None, and in a dict, key `k` then gets a neighbour `k + "_note"` saying why (from
    `NONFINITE_NOTES`, unless the dict already has that key: a writer that knows the reason
    sets it). A list holding such values gets the note under its own key:
    `"xs": [0.5, null], "xs_note": "null entries: undefined (NaN): ..."`.

    JSON has no NaN or Infinity: `json.dumps` writes the bare tokens `NaN` / `Infinity`, which
    are not JSON and which most readers (jq, JavaScript, strict parsers) reject.
    """

    def walk(x: Any) -> tuple[Any, str | None]:  # (copy, note when x held a non-finite float)
        kind = _nonfinite_kind(x)
        if kind is not None:
            return None, NONFINITE_NOTES[kind]
        if isinstance(x, dict):
            out: dict = {}
            notes: dict = {}
            for k, v in x.items():
                out[k], note = walk(v)
                if note is not None and isinstance(k, str) and f"{k}_note" not in x:
                    notes[f"{k}_note"] = note
            for k, note in notes.items():
                out[k] = note
            return out, None
        if isinstance(x, list | tuple):
            items = [walk(v) for v in x]
            note = next((n for _, n in items if n is not None), None)
            return [v for v, _ in items], (None if note is None else f"null entries: {note}")
        return x, None

    return walk(obj)[0]


def to_json(obj: Any, **dumps_kwargs) -> str:
    """The one way rlhflab serialises JSON into files: secrets redacted in string values
    (`redact_obj`), NaN / ±inf written as null with a `<key>_note` beside them
    (`finite_json`), and `allow_nan=False`, so a non-finite number that slipped past raises
    ValueError instead of writing invalid JSON."""
    return json.dumps(finite_json(redact_obj(obj)), allow_nan=False, **dumps_kwargs)


_FLOAT_TAG = "__nonfinite_float__"


def encode_nonfinite(obj: Any) -> Any:
    """A copy of a JSON-like object with each NaN / ±inf float replaced by the object
    `{"__nonfinite_float__": "nan" | "inf" | "-inf"}`: for state that must round-trip exactly
    (checkpoint state.json, read back with `json.loads(text, object_hook=decode_nonfinite)`)."""
    kind = _nonfinite_kind(obj)
    if kind is not None:
        return {_FLOAT_TAG: kind}
    if isinstance(obj, dict):
        return {k: encode_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_nonfinite(v) for v in obj]
    return obj


def decode_nonfinite(d: dict) -> Any:
    """`json.loads` object_hook undoing `encode_nonfinite`."""
    if len(d) == 1 and _FLOAT_TAG in d:
        return float(d[_FLOAT_TAG])
    return d


def redact_json(obj: Any, **dumps_kwargs) -> str:
    """`to_json` (secrets redacted, no NaN / Infinity); kept under its old name."""
    return to_json(obj, **dumps_kwargs)


def write_text_atomic(path: Path, text: str) -> None:
    """Write free `text` (secrets redacted) to a temporary file beside `path`, fsync, then rename
    over `path`. Structured data goes through `write_json_atomic` / `write_yaml_atomic`."""
    _write_atomic(path, redact(text))


def current_umask() -> int:
    """The process's file-mode creation mask. Read from /proc/self/status where it exists (no
    change to the mask); elsewhere set and restored (`os.umask` has no read-only form)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def match_umask(path: str | os.PathLike) -> None:
    """Give a file, or every regular file directly inside a directory, the mode an ordinary
    `open` gives (0o666 less the umask: 0644 under umask 022). For writers that create their
    files 0600 whatever the umask: safetensors (0.8) does, so model and checkpoint weights would
    be unreadable by the group beside 0644 configs. Symbolic links are left alone."""
    mode = 0o666 & ~current_umask()
    path = Path(path)
    files = [path] if not path.is_dir() else [p for p in path.iterdir()]
    for f in files:
        if f.is_file() and not f.is_symlink():
            os.chmod(f, mode)


def _write_atomic(path: Path, text: str) -> None:
    """`text` to a temporary file beside `path`, fsync, rename. The file gets the mode an ordinary
    `open` would give it (0o666 less the umask: 0644 under umask 022), not mkstemp's 0600, so
    results, configs and reports are readable by whoever may read the rest of the run."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Atomic write of `obj` as pretty JSON (`to_json`: secrets redacted in string values only,
    NaN / ±inf as null with a `<key>_note`)."""
    _write_atomic(path, redact_json(obj, indent=2, sort_keys=False) + "\n")


def write_yaml_atomic(path: Path, obj: Any) -> None:
    """Atomic write of `obj` as YAML (keys in order), secrets redacted in string values only."""
    import yaml

    _write_atomic(path, yaml.safe_dump(redact_obj(obj), sort_keys=False))
