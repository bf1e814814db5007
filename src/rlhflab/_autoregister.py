"""Register rlhflab's own architectures with transformers' Auto classes when `rlhflab` is
imported, without making `import rlhflab` heavy.

A model saved from the from-scratch GPT (`model.build.arch: gpt`, `model_type` "rlhflab_gpt")
loads with plain `AutoModelForCausalLM.from_pretrained(path)` only once `rlhflab.models.gpt` has
run its `AutoConfig.register` / `AutoModelForCausalLM.register` calls. That module imports torch
and transformers' modelling code (seconds), so `import rlhflab` does not import it. Instead:

* transformers already imported: register now (the user has paid for transformers already);
* otherwise: a one-shot import hook on the top-level `transformers` package registers right after
  `transformers/__init__.py` has run, i.e. on the first `import transformers` /
  `from transformers import ...`, before any Auto class can be used. The hook removes itself
  after it fires and hands the package its own loader back.

`import rlhflab` itself imports only the standard library. A registration that fails (a broken
torch install) is a warning, never an error inside the user's `import transformers`.

`when_imported(fn)` lets other code (`rlhflab.quiet`) act on transformers without importing it:
`fn` runs right away if transformers is imported, else from the same hook.
"""

from __future__ import annotations

import sys
import warnings

_TARGET = "transformers"
_CALLBACKS: list = []  # when_imported: run once, after transformers/__init__.py


def register_models() -> None:
    """Register rlhflab's architectures (today: the GPT, `model_type` "rlhflab_gpt") with
    `AutoConfig`, `AutoModelForCausalLM` and `AutoModelForSequenceClassification`: importing
    `rlhflab.models.gpt` does it (its registrations pass `exist_ok=True`, so this is idempotent).
    Imports torch and transformers."""
    import rlhflab.models.gpt  # noqa: F401  (registers on import)


def _register_quietly() -> None:
    try:
        register_models()
    except Exception as exc:  # never break the user's own `import transformers`
        warnings.warn(
            f"rlhflab could not register its GPT architecture with transformers ({exc}); "
            "import rlhflab.models.gpt before loading an rlhflab_gpt model",
            stacklevel=2,
        )


class _Loader:
    """Delegates to the package's own loader, then registers and restores that loader.
    (Duck-typed `importlib.abc.Loader`: importing importlib.abc costs ~50 ms.)"""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.loader
        _run_callbacks()
        _register_quietly()


def _run_callbacks() -> None:
    while _CALLBACKS:
        fn = _CALLBACKS.pop(0)
        try:
            fn()
        except Exception as exc:  # never break the user's own `import transformers`
            warnings.warn(f"rlhflab: {fn!r} failed after transformers' import: {exc}", stacklevel=2)


def when_imported(fn) -> object:
    """Call `fn()` once transformers is imported: now if it is, else right after its first
    import (the hook of `install`). Returns a token for `cancel`."""
    if _TARGET in sys.modules:
        fn()
        return fn
    _CALLBACKS.append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return fn


def cancel(token: object) -> None:
    """Drop a `when_imported` callback that has not run yet (nothing if it has)."""
    if token in _CALLBACKS:
        _CALLBACKS.remove(token)


class _Finder:
    """One-shot: wraps the loader of the `transformers` package, then leaves sys.meta_path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        uninstall()  # before asking the other finders (importlib.util.find_spec's walk, without
        # importing importlib.util, ~10 ms)
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Register now when transformers is imported, else on its first import (see module doc)."""
    if _TARGET in sys.modules:
        _register_quietly()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the import hook (nothing when it is not installed)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
