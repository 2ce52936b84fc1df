"""The chat app: sending, streaming, stopping, loading, long chats, saving, what text is shown as."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from moechat.app.screens.chat import SHOWN_TURNS, ChatScreen
from moechat.app.settings import Settings, resolve
from moechat.app.tui import MoechatApp
from moechat.engine.events import Event
from moechat.widgets.chat_log import ChatInput, EarlierMarker, ReplyMarkdown, StreamedParagraph, Turn
from moechat.widgets.dashboard import Dashboard
from testkit.fake_engine import FakeEngine
from testkit.ggufgen import tiny_moe
from testkit.pilot import WORDS, drawn, make_app, on_screen, ready, reply_markdown, say, until
from textual.binding import Binding
from textual.widgets import Markdown, Static


async def test_send_streams_a_reply_and_saves_the_conversation(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        assert screen.conv.messages[0] == {"role": "user", "content": "hi"}
        assert screen.conv.messages[1]["content"] == "The river rose in spring."
        await until(pilot, lambda: "The river rose" in reply_markdown(screen))
        status = str(screen.query_one("#status", Static).content)
        assert "reply 6 tok" in status and "first token" in status and "context" in status
        # ... and all of it is on the screen: it wraps beside the dashboard instead of being cut.
        await until(pilot, lambda: "context" in on_screen(screen.query_one("#status", Static)))
        assert "eos" in on_screen(screen.query_one("#status", Static))
        saved = json.loads(app.store.path(screen.conv.id).read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
        # Up recalls the earlier prompt.
        await pilot.press("up")
        assert screen.query_one("#input").text == "hi"
        assert gc.get_freeze_count() > 0  # the app's long-lived heap is out of the collector's way
    assert gc.get_freeze_count() == 0  # ... until the app ends


def test_markdown_still_builds_paragraphs_from_the_private_class_the_chat_subclasses() -> None:
    """The chat's StreamedParagraph extends Textual's unexported MarkdownParagraph and swaps it into
    Markdown.BLOCKS: if Textual renames or stops using it, this fails here, not on a user's screen."""
    from moechat.widgets.chat_log import MarkdownParagraph

    assert Markdown.BLOCKS["paragraph_open"] is MarkdownParagraph
    assert issubclass(StreamedParagraph, MarkdownParagraph)


@pytest.mark.slow
async def test_a_streamed_reply_relays_out_only_as_it_grows_and_is_drawn_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from textual.app import App, ComposeResult

    layouts: list[bool] = []  # the layout flag of each update of the reply's paragraph on the screen
    update = Static.update

    def spy(self: Static, content: Any = "", *, layout: bool = True) -> None:
        if isinstance(self, StreamedParagraph) and self.is_mounted:
            layouts.append(layout)
        update(self, content, layout=layout)

    monkeypatch.setattr(Static, "update", spy)

    class OneReply(App[int]):  # nothing else on the screen relays it out
        def compose(self) -> ComposeResult:
            yield ReplyMarkdown()

    app = OneReply()
    async with app.run_test(size=(40, 20)) as pilot:
        md = app.query_one(ReplyMarkdown)
        stream = Markdown.get_stream(md)
        words: list[str] = []

        def words_on_screen() -> list[str]:
            return [w for p in md.query(StreamedParagraph) for w in on_screen(p).split()]

        for i in range(60):  # one word an append: wraps onto a new line every few
            words.append(f"w{i}")
            await stream.write(f" w{i}")
            await until(pilot, lambda: words_on_screen() == words)  # each word there: it grew when it had to
        await stream.stop()
        assert md.query_one(StreamedParagraph).size.height >= 6
        assert layouts.count(False) > layouts.count(True) > 1  # ... and kept its layout when it did not


@pytest.mark.slow
async def test_escape_stops_within_a_token_and_the_next_request_works(tmp_path: Path) -> None:
    engine = FakeEngine([f" w{i}" for i in range(400)], delay=0.01)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await pilot.press("h", "enter")
        await until(pilot, lambda: engine.tokens >= 5)
        box = screen.query_one(ChatInput)
        # While a reply streams the input's cursor stays lit instead of blinking (a blink is a frame).
        assert box.cursor_blink is False and box._cursor_visible and box.has_focus
        await pilot.press("escape")
        await until(pilot, lambda: not screen.generating)
        assert box.cursor_blink is True  # ... and blinks again once the reply ends
        last = screen.conv.messages[-1]
        assert last["stopped"] is True and 0 < len(last["content"].split()) < 400
        assert engine.tokens < 400
        assert "[stopped]" in drawn(screen.query(Turn).last().query_one(".role", Static))
        engine.words, engine.delay = WORDS, 0.0
        await say(pilot, screen, "again")
        assert screen.conv.messages[-1]["content"] == "The river rose in spring."


async def test_regenerate_replaces_the_last_reply(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        engine.words = ["Another", " reply"]
        await pilot.press("ctrl+r")
        await until(pilot, lambda: engine.replies == 2 and not screen.generating)
        assert [m["role"] for m in screen.conv.messages] == ["user", "assistant"]
        assert screen.conv.messages[-1]["content"] == "Another reply"
        assert len(screen.query(Turn)) == 2


@pytest.mark.slow
async def test_engine_failure_is_shown_and_the_app_stays_usable(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS, fail_after=3)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        assert "injected engine failure" in str(screen.query_one("#status", Static).content)
        saved = json.loads(app.store.path(screen.conv.id).read_text())
        assert saved["messages"][1]["content"] == "The river rose"  # the part written before the failure
        engine.fail_after = None
        await say(pilot, screen, "again")
        assert screen.conv.messages[-1]["content"] == "The river rose in spring."


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing", "fake", "truncated"])
async def test_a_model_that_does_not_load_stays_on_screen_and_the_app_exits_non_zero(tmp_path: Path, kind: str) -> None:
    """The real engine process on a bad file: its one-line error replaces the spinner until a key is pressed."""
    from moechat.app.paths import AppPaths
    from moechat.app.tui import LoadFailed, real_engine_factory
    from textual.widgets import Label

    model = tmp_path / "model.gguf"
    if kind == "fake":
        model.write_bytes(b"not a model at all, just some bytes" * 10)
    elif kind == "truncated":
        whole = tiny_moe(tmp_path / "whole.gguf").read_bytes()
        model.write_bytes(whole[: len(whole) // 2])
    settings = Settings()
    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    app = MoechatApp(real_engine_factory(str(model), settings, None), settings, paths=paths)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.failure is not None, timeout=120)
        await until(pilot, lambda: isinstance(app.screen, LoadFailed) and bool(app.screen.query("#what")))
        shown = str(app.screen.query_one("#what", Label).render())
        assert shown.startswith("moechat: error:") and "model.gguf" in shown, shown
        assert "\n" not in shown
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)
    assert app.return_code == 2


def _loading_app(tmp_path: Path, engine: FakeEngine, fail: str = "") -> tuple[MoechatApp, Any, list[str]]:
    """An app whose engine loads only when the test says so (`go.set()`), reporting progress meanwhile."""
    import threading

    from moechat.app.paths import AppPaths

    go = threading.Event()
    said: list[str] = []

    def factory(progress: Any) -> FakeEngine:
        progress("compiling kernels for this model (first start only) [....................] 1 of about 200")
        said.append("progress")
        go.wait(30)
        if fail:
            raise ValueError(fail)
        return engine

    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    return MoechatApp(factory, Settings(), paths=paths), go, said


async def test_the_input_works_while_the_model_loads_and_a_queued_message_gets_its_reply(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app, go, said = _loading_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and isinstance(app.focused, ChatInput))
        screen = app.screen
        assert isinstance(screen, ChatScreen) and app.engine is None
        info = screen.query_one("#info", Static)
        await until(pilot, lambda: "1 of about 200" in drawn(info))  # the load's progress, on the chat screen
        for ch in "hi":
            await pilot.press(ch)
        await pilot.press("enter")
        await until(pilot, lambda: len(screen.conv.messages) == 1)
        assert screen.conv.messages[0]["content"] == "hi" and len(screen.query(Turn)) == 1
        status = screen.query_one("#status", Static)
        assert "queued" in drawn(status) and not screen.generating
        # A second message, the wizard and the export wait for the engine too: refused, nothing changes.
        await pilot.press("x", "enter")
        await pilot.press("ctrl+t")
        await pilot.press("ctrl+e")
        await until(pilot, lambda: len(app._notifications) >= 3)
        notes = " | ".join(n.message for n in app._notifications)
        assert "already waits" in notes and "wizard runs once the model is loaded" in notes, notes
        assert app.screen is screen and len(screen.conv.messages) == 1
        assert not (tmp_path / "data" / "exports").exists()
        go.set()
        await until(pilot, lambda: len(screen.conv.messages) == 2 and not screen.generating)
        assert screen.conv.messages[1]["content"] == "The river rose in spring."
        assert screen.conv.model == engine.info.name and engine.info.name in drawn(info)
        assert "reply 6 tok" in drawn(status)
        assert said == ["progress"]


async def test_a_load_that_fails_keeps_the_message_sent_meanwhile(tmp_path: Path) -> None:
    from moechat.app.tui import LoadFailed

    app, go, _ = _loading_app(tmp_path, FakeEngine(WORDS), fail="m.gguf: unsupported architecture 'mamba'")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.focused, ChatInput))
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        for ch in "keep me":
            await pilot.press(ch if ch != " " else "space")
        await pilot.press("enter")
        await until(pilot, lambda: len(screen.conv.messages) == 1)
        go.set()
        await until(pilot, lambda: isinstance(app.screen, LoadFailed) and bool(app.screen.query("#what")))
        assert "unsupported architecture" in str(app.screen.query_one("#what").render())
        saved = json.loads(app.store.path(screen.conv.id).read_text())
        assert saved["messages"] == [{"role": "user", "content": "keep me"}]
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)
    assert app.return_code == 2


async def test_runs_at_80x24(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        await pilot.press("ctrl+b")
        assert not screen.query_one(Dashboard).display
        await pilot.press("ctrl+b")
        assert screen.query_one(Dashboard).display


def shown(screen: ChatScreen) -> list[str]:
    """The text of each turn in the log, as its Markdown holds it (streamed replies included)."""
    return [t.query_one(Markdown).source.strip() for t in screen.query(Turn)]


@pytest.mark.slow
async def test_long_chats_keep_the_recent_turns_and_bring_earlier_ones_back(tmp_path: Path) -> None:
    # Each text update relays out every widget in the log: a long chat keeps only its recent turns.
    engine = FakeEngine(["ok"])
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        for i in range(8):
            await say(pilot, screen, f"q{i}")
        n = len(screen.conv.messages)
        assert n == 16 and screen.first_shown == n - SHOWN_TURNS
        assert shown(screen) == [m["content"] for m in screen.conv.messages[n - SHOWN_TURNS :]]
        marker = screen.query_one(EarlierMarker)
        assert marker.display and f"{n - SHOWN_TURNS} earlier messages" in str(marker.content)

        # Scrolling to the top brings the earlier turns back, and the view stays on the turn it showed.
        log = screen.query_one("#log")
        assert log.max_scroll_y > 0
        oldest = screen.query(Turn).first()
        log.scroll_home(animate=False)
        await until(pilot, lambda: screen.first_shown == 0)
        assert shown(screen) == [m["content"] for m in screen.conv.messages]
        assert not marker.display
        await until(pilot, lambda: log.scroll_y == oldest.virtual_region.y > 0)

        # The next exchange trims again; the reply still streams in and is saved in full.
        await say(pilot, screen, "again")
        assert len(screen.query(Turn)) == SHOWN_TURNS and screen.first_shown == 18 - SHOWN_TURNS
        assert screen.conv.messages[-1]["content"] == "ok" and len(screen.conv.messages) == 18


@pytest.mark.slow
async def test_reopened_long_chat_mounts_its_last_turns_and_a_click_shows_more(tmp_path: Path) -> None:
    engine = FakeEngine(["ok"])
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 80)) as pilot:  # tall: every turn shown fits, the marker too
        screen = await ready(pilot)
        conv = screen.conv
        conv.messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(30)]
        await screen.load_conversation(conv)
        assert screen.first_shown == 30 - SHOWN_TURNS and shown(screen) == [f"m{i}" for i in range(18, 30)]
        await pilot.pause()  # laid out: the marker has its place on the screen
        await pilot.click(EarlierMarker)
        await until(pilot, lambda: screen.first_shown == 8)
        assert shown(screen) == [f"m{i}" for i in range(8, 30)]
        screen.query_one("#log").scroll_home(animate=False)  # the view stayed put: the rest is above
        await until(pilot, lambda: screen.first_shown == 0)
        assert shown(screen) == [f"m{i}" for i in range(30)]
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not screen.query(Turn))
        assert screen.first_shown == 0 and not screen.query_one(EarlierMarker).display


@pytest.mark.slow
async def test_command_palette_has_every_chat_action(tmp_path: Path) -> None:
    engine = FakeEngine(["ok"])
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        titles = {c.title for c in app.get_system_commands(screen)}
        for binding in ChatScreen.BINDINGS:
            assert isinstance(binding, Binding)
            action = getattr(screen, f"action_{binding.action}")
            assert any(c.callback == action for c in app.get_system_commands(screen)), binding.action
        assert "Earlier messages" in titles
        # Run one through the palette: a reopened long chat shows its earlier turns.
        conv = screen.conv
        conv.messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20)]
        await screen.load_conversation(conv)
        await pilot.pause()
        assert screen.first_shown == 20 - SHOWN_TURNS  # laid out at the bottom: nothing came back by itself
        await pilot.press("ctrl+p")
        for ch in "Earlier":
            await pilot.press(ch)
        await pilot.press("enter")
        await until(pilot, lambda: screen.first_shown == 0)
        assert shown(screen) == [f"m{i}" for i in range(20)]


@pytest.mark.slow
async def test_conversations_reopen_and_theme_is_remembered(tmp_path: Path) -> None:
    from moechat.app.screens.dialogs import OpenChat

    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "first chat")
        first_id = screen.conv.id
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not screen.conv.messages and not screen.query(Turn))
        await say(pilot, screen, "second")
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, OpenChat))
        titles = [c.title for c in app.screen.conversations]
        assert titles == ["second", "first chat"]
        await pilot.press("down", "enter")
        await until(pilot, lambda: app.screen is screen and screen.conv.id == first_id)
        await until(pilot, lambda: len(screen.query(Turn)) == 2)
        assert screen.conv.messages[0]["content"] == "first chat"
        app.theme = "nord"
        await until(pilot, lambda: app.config_path.is_file())
        assert resolve({}, {}, app.config_path)[0].theme == "nord"


@pytest.mark.slow
async def test_a_failing_save_is_reported_and_the_old_file_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import moechat.app.atomic as atomic

    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    shown: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "first")
        saved = app.store.path(screen.conv.id)
        before = saved.read_bytes()

        def full_disk(src: str, dst: str) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(atomic.os, "replace", full_disk)
        monkeypatch.setattr(app, "notify", lambda message, **kw: shown.append(str(message)))
        await say(pilot, screen, "second")
        assert any("could not save the conversation" in m and "No space" in m for m in shown)
        assert saved.read_bytes() == before
        assert app.export_all(tmp_path / "exports") == []
        assert any("export failed" in m for m in shown)
        assert [m["content"] for m in screen.conv.messages][-2:] == ["second", "The river rose in spring."]


MARKUP = "[/x] a [b]b[/b] [@click=app.quit]q[/] [/]"


@pytest.mark.slow
async def test_text_from_users_files_and_errors_is_shown_as_written_never_as_markup(tmp_path: Path) -> None:
    """Square brackets in a prompt, a system prompt or an error are text: Textual's markup would
    swallow them ("[stopped]"), run them ("[@click=...]") or fail on them ("[/x]": MarkupError)."""
    from moechat.app.screens.dialogs import OpenChat
    from textual.widgets import OptionList

    class FailsWithBrackets(FakeEngine):
        def reply(self, *args: Any, **kw: Any) -> Iterator[Event]:
            if self.replies >= 1:
                raise RuntimeError(f"bad state {MARKUP}")
            return super().reply(*args, **kw)

    engine = FailsWithBrackets(WORDS)
    app = make_app(tmp_path, engine, Settings(system=f"be brief {MARKUP}"))
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        screen = await ready(pilot)
        assert f"system: be brief {MARKUP}"[:40] in drawn(screen.query_one("#info", Static))
        await say(pilot, screen, MARKUP)
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not screen.query(Turn))
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, OpenChat))
        option = app.screen.query_one(OptionList).get_option_at_index(0)
        assert str(option.prompt).endswith(MARKUP)
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is screen and len(screen.query(Turn)) == 2)
        assert drawn(screen.query_one("#status", Static)) == f"reopened: {MARKUP}"
        engine.replies = 1
        await say(pilot, screen, "again")
        assert drawn(screen.query_one("#status", Static)) == f"error: RuntimeError: bad state {MARKUP}"
        assert "[error]" in drawn(screen.query(Turn).last().query_one(".role", Static))
        # The notification ("the engine failed: ...") shows it as written too.
        await until(pilot, lambda: any(MARKUP in str(t.render()) for t in app.screen.query("Toast")))
        assert app.is_running
