"""What the app asks of an engine: the chat every engine serves, what a local one adds, and the engine's
errors crossing the pipe and reaching a server's client as one declared table of kinds."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import moechat.engine
import moechat.tuner
import pytest
from moechat.app.engine_api import ENGINE_ERRORS, ChatEngine, LocalEngine, error_kind, local
from moechat.app.engine_process import EngineProcessError, ProcessEngine
from moechat.tuner.events import Cancelled

# What the engine process runs: the engine, the tuner, and the app's modules it imports.
APP_MODULES = ("moechat.app.real_engine", "moechat.app.settings", "moechat.app.engine_process", "moechat.demo.build",
               "moechat.demo.source")  # fmt: skip


def engine_exceptions() -> set[type[BaseException]]:
    names = [*APP_MODULES]
    for package in (moechat.engine, moechat.tuner):
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    found = set()
    for name in names:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                found.add(cls)
    return found


def test_every_engine_exception_has_a_kind() -> None:
    """A new exception class of the engine without a row would reach a client as a bare 500 "internal"."""
    classes = engine_exceptions()
    assert len(classes) >= 15  # the walk found them (ParameterError, GGUFError, ContextFull, ...)
    missing = sorted(c.__name__ for c in classes if c.__name__ not in ENGINE_ERRORS)
    assert missing == [], f"add these to engine_api.ENGINE_ERRORS with their HTTP status: {missing}"
    assert all(status in (400, 499, 500, 503) for status in ENGINE_ERRORS.values())


def test_an_error_crosses_as_its_nearest_named_kind() -> None:
    from moechat.engine.cache.settings import CacheError
    from moechat.engine.generate import ContextFull

    assert error_kind(CacheError("mib", "no")) == "CacheError"
    assert error_kind(ContextFull("full")) == "ContextFull"
    assert error_kind(KeyError("x")) == "internal"

    class Unlisted(ValueError):
        pass

    assert error_kind(Unlisted("x")) == "ValueError"  # a subclass of a listed kind takes its nearest row


@pytest.mark.parametrize("kind", sorted(ENGINE_ERRORS))
def test_the_app_side_raises_each_kind_as_its_status_says(kind: str) -> None:
    with pytest.raises(Exception) as raised:
        ProcessEngine._raise(kind, "what went wrong")
    status = ENGINE_ERRORS[kind]
    if kind == "Cancelled":
        assert raised.type is Cancelled
    elif status == 400:
        assert raised.type is ValueError and str(raised.value) == "what went wrong"
    else:
        assert isinstance(raised.value, EngineProcessError) and raised.value.status == status


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def test_an_attached_engine_serves_the_chat_and_stubs_nothing() -> None:
    """`moechat attach`'s engine has every chat method and none of a local engine's (no method that only
    raises); where the app asks it for one, it hears where that runs."""
    from moechat.app.real_engine import RealEngine
    from moechat.app.serve.remote import RemoteEngine

    chat, extra = members(ChatEngine) - {"info"}, members(LocalEngine) - members(ChatEngine)
    assert {"reply", "snapshot", "fit_messages"} <= chat and {"sweep", "set_cache", "encode"} <= extra
    assert chat <= set(vars(RemoteEngine)) and not extra & set(dir(RemoteEngine))
    for engine in (RealEngine, ProcessEngine):
        assert chat | extra <= set(dir(engine)), engine
    remote = RemoteEngine.__new__(RemoteEngine)  # (no server to reach: the check is on the type)
    assert not isinstance(remote, LocalEngine)
    with pytest.raises(ValueError, match="tuning runs on the server's machine"):
        local(remote, "tuning")
