"""The chat screen: it composes the conversation, input, status line and dashboard, and owns their state.

A reply runs in a thread worker (`reply_stream.stream_reply`) that never touches widgets: it
posts messages, and the handlers here update the screen and save the conversation.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any, ClassVar

from moechat.app.conversations import Conversation
from moechat.app.export import reply_record, reply_stats
from moechat.app.messages import BoundUpdate, ContextTrimmed, ReplyDone, ReplyFailed, StatsUpdate, TokenText
from moechat.app.reply_stream import stats_update, stream_reply
from moechat.app.screens.dialogs import OpenChat, SettingsDialog
from moechat.app.screens.host import ScreenHost, host_of
from moechat.app.screens.wizard import TuneWizard
from moechat.app.settings import sampling_params
from moechat.engine.events import SamplingParams
from moechat.widgets.chat_log import ChatInput, EarlierMarker, Turn, turn_for
from moechat.widgets.dashboard import Dashboard, batch_rows
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Markdown, Static
from textual.widgets.markdown import MarkdownStream

logger = logging.getLogger(__name__)


# Turns the log holds as widgets; earlier ones come back on request. Every text update relays out
# the screen, at a cost for each widget in it: with 50 turns shown the UI took 18-20% of a core
# while streaming, twice what a fresh chat takes (bench/ui_long_chat.py).
SHOWN_TURNS = 12
REVEAL_TURNS = 10  # turns brought back at a time


class ChatScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "open_chat", "Open"),
        Binding("ctrl+t", "tune", "Tune"),
        Binding("ctrl+e", "export", "Export", priority=True),  # over the input's end-of-line: End does that
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+b", "toggle_dashboard", "Dashboard"),
    ]
    DEFAULT_CSS = """
    #chat-pane { width: 1fr; }
    #info { height: auto; color: $text-muted; padding: 0 1; }
    #log { height: 1fr; padding: 0 1; }
    /* The numbers after a reply wrap onto more lines beside the dashboard (4 at 80 columns), never cut. */
    #status { height: auto; max-height: 4; color: $text-muted; padding: 0 1; }
    ChatInput { height: 5; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.stop_event = threading.Event()
        self.generating = False
        self.conv = Conversation()
        self._stream: MarkdownStream | None = None
        self._reply_text = ""
        self._reply_turn: Turn | None = None
        self._reply_settings: dict[str, Any] = {}  # what the reply in progress runs with, for the export
        self.stats_updates = 0  # StatsUpdate messages handled (tests bound their rate)
        self.first_shown = 0  # index in conv.messages of the oldest turn in the log
        self._composed = False  # on_mount has run: the load's news can reach the widgets
        self._load_text = "loading the model..."  # the load's latest news, shown once composed
        self._cache_note = ""  # the engine's words on its cache as shown (a first start's change on takeover)

    @property
    def moechat(self) -> ScreenHost:
        return host_of(self)

    def compose(self) -> ComposeResult:
        with Horizontal():
            with Vertical(id="chat-pane"):
                yield Static(id="info", markup=False)  # names and the system prompt, as written
                with VerticalScroll(id="log"):
                    yield EarlierMarker(id="earlier")
                yield Static("", id="status", markup=False)
                yield ChatInput(id="input")
            yield Dashboard(id="dashboard")
        yield Footer()

    def on_screen_resume(self) -> None:
        # Back from the wizard or the settings: a cache they changed starts its counters again.
        self.query_one(Dashboard).show_scope(bool(self.moechat.session.periods))

    @property
    def loaded(self) -> bool:
        return self.moechat.engine is not None

    def on_mount(self) -> None:
        self._composed = True
        self.conv.system = self.moechat.settings.system
        log = self.query_one("#log", VerticalScroll)
        log.anchor()
        self.query_one(EarlierMarker).display = False
        self.watch(log, "scroll_y", self._scrolled)
        if self.loaded:
            self.engine_ready()
        else:
            self.show_loading(self._load_text)
            self.query_one("#status", Static).update(
                "the model is loading: type now, the reply starts once it is ready"
            )
        self.query_one(ChatInput).focus()
        if self.moechat.attached:  # another client's replies move the server's numbers too: look at them
            self.set_interval(self.moechat.settings.refresh_ms / 1000, self._watch_server)
        # What exists now (modules, the app, this screen's widgets) lives as long as the app:
        # moved out of the collector's sight, the collections that streaming's many short-lived
        # objects set off scan far less (UI CPU while streaming 14.0 -> 12.1% of a core, A/B).
        gc.freeze()

    def _watch_server(self) -> None:
        if self.loaded and not self.generating and not self.moechat.engine_lock.locked():
            self.server_stats()

    @work(thread=True, exclusive=True, group="watch")
    def server_stats(self) -> None:
        """The attached server's snapshot and its reply's pace now (whoever asked for that reply)."""
        engine = self.moechat.engine
        try:
            snap = engine.snapshot()
        except ValueError as e:  # the server is gone or busy: the next look tries again
            logger.warning("%s", e, exc_info=True)
            return
        live = getattr(engine, "live_tokens", 0), getattr(engine, "live_tps", 0.0)
        self.post_message(stats_update(snap, live[0], live[1], full=True, batch=getattr(engine, "live_batch", None)))

    def show_loading(self, text: str) -> None:
        """What the engine's load is doing (the demo's build, the kernels a first start compiles)."""
        self._load_text = text
        if self._composed and not self.loaded:
            self.query_one("#info", Static).update(text)

    def engine_ready(self) -> None:
        """The engine is loaded: its description on the info line, and a message sent meanwhile gets its reply."""
        if not self._composed:
            return  # on_mount calls it
        info = self.moechat.engine.info
        self.conv.model = info.name
        self._cache_note = info.cache_note
        self.query_one(Dashboard).off_note = info.cache_note if info.cache_note.startswith("auto: off") else ""
        self.query_one(Dashboard).copied = "uploaded" if info.device != "cpu" else "copied"
        self.refresh_info()
        if info.template_note:
            self.notify(f"{info.template_note}; using the plain format", severity="warning")
        if self.conv.messages and self.conv.messages[-1]["role"] == "user" and not self.generating:
            self.run_worker(self.start_reply(), group="queued")
        else:
            self.query_one("#status", Static).update("ready")

    def _loading_refused(self, what: str) -> bool:
        if self.loaded:
            return False
        self.notify(f"{what} once the model is loaded", severity="warning")
        return True

    def refresh_info(self) -> None:
        if not self.loaded:
            return
        app = self.moechat
        s, info = app.settings, app.engine.info
        mib, share = app.cache_in_effect
        system = (s.system[:40] + "...") if len(s.system) > 40 else (s.system or "none")
        self.query_one("#info", Static).update(
            f"{info.name} ({info.arch}, {info.device}) | template: {info.template} | cache {mib:g} MiB, "
            f"share {share:g}{f' ({info.cache_note})' if info.cache_note else ''}"
            f"\nsystem: {system} | temp {s.temp:g}, top-k {s.top_k}, top-p {s.top_p:g}, "
            f"min-p {s.min_p:g}"
            + (f", repeat penalty {s.repeat_penalty:g}" if s.repeat_penalty != 1 else "")
            + f", max {s.n_predict} tokens"
        )

    # -- sending and streaming ------------------------------------------------------------

    @on(ChatInput.Submitted)
    async def send(self, event: ChatInput.Submitted) -> None:
        if self.generating:
            self.notify("a reply is still being written: Esc stops it", severity="warning")
            return
        if not self.loaded and self.conv.messages and self.conv.messages[-1]["role"] == "user":
            self.notify("a message already waits for the model to load", severity="warning")
            return
        self.conv.messages.append({"role": "user", "content": event.text})
        log = self.query_one("#log", VerticalScroll)
        await log.mount(Turn("user", event.text))
        log.scroll_end(animate=False)  # a new exchange: follow it, even if the user had scrolled up
        if not self.loaded:  # it waits: engine_ready starts its reply
            self.query_one("#status", Static).update("queued: the reply starts once the model is loaded")
            return
        await self.start_reply()

    async def start_reply(self) -> None:
        turn = Turn("assistant", "")
        await self.query_one("#log").mount(turn)
        await self._keep_recent()
        self._reply_turn, self._reply_text = turn, ""
        self._stream = Markdown.get_stream(turn.query_one(Markdown))
        self.generating = True
        # The bound covers the lookups up to the last reply: beside a hit rate that moves on, it would
        # be another window's. It comes back, on this reply's lookups too, when the reply ends.
        self.query_one(Dashboard).show_bound(None)
        # A steady cursor while the reply streams: each blink is a frame of its own, 29 in a
        # 200-token demo reply, about a tenth of the UI's CPU then (9.4 -> 8.5% of a core).
        self.query_one(ChatInput).cursor_blink = False
        self.stop_event.clear()
        self.query_one("#status", Static).update("reading the prompt...")
        s = self.moechat.settings
        self._reply_settings = self.moechat.settings_dict()  # as the reply starts: a change during it is the next's
        self.generate(self.conv.chat_messages(), sampling_params(s), s.n_predict, s.refresh_ms / 1000)

    @work(thread=True, exclusive=True, group="engine")
    def generate(self, messages: list[dict[str, str]], params: SamplingParams, n_predict: int, every: float) -> None:
        try:
            with self.moechat.engine_lock:
                stream_reply(self.moechat.engine, messages, params, n_predict, self.stop_event, every,
                             self.post_message)  # fmt: skip
        except Exception as e:  # the UI shows it; the conversation so far is saved
            self.post_message(ReplyFailed(f"{type(e).__name__}: {e}"))

    async def on_token_text(self, msg: TokenText) -> None:
        self._reply_text += msg.text
        if self._stream is not None:
            await self._stream.write(msg.text)

    def on_stats_update(self, msg: StatsUpdate) -> None:
        self.stats_updates += 1
        recent = self.moechat.session.add(msg.snapshot, msg.tokens, msg.tps)  # the window is computed once, there
        dash = self.query_one(Dashboard)
        if msg.batch is not None:
            dash.server_rows = batch_rows(msg.batch)
        dash.show_scope(bool(self.moechat.session.periods))
        dash.show(msg.snapshot, msg.tokens, msg.tps, msg.upload_mib_per_token, msg.full, recent)
        if self.generating and msg.tps:
            self.query_one("#status", Static).update(f"writing... {msg.tokens} tokens, {msg.tps:.1f} t/s", layout=False)

    def on_context_trimmed(self, msg: ContextTrimmed) -> None:
        if msg.dropped:
            self.notify(f"the conversation outgrew the context: the {msg.dropped} oldest message(s) are left out")
        if msg.note:
            self.notify(msg.note, severity="warning", timeout=10)
            self.refresh_info()

    async def _finish(self, note: str) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.generating = False
        self.query_one(ChatInput).cursor_blink = True
        stopped = note == "stopped"
        msg: dict[str, Any] = {"role": "assistant", "content": self._reply_text.strip(), "stopped": stopped}
        self.conv.messages.append(msg)
        if self._reply_turn is not None and note:
            self._reply_turn.set_note(note)
        self.moechat.save_conversation(self.conv)

    async def on_reply_done(self, msg: ReplyDone) -> None:
        d = msg.done
        await self._finish("stopped" if d.stop_reason == "stopped" else "")
        engine, note = self.moechat.engine, self.moechat.engine.info.cache_note
        if note != self._cache_note:  # a first start's fast kernels took over: their cache is in effect now
            self._cache_note = note
            self.moechat.cache_in_effect = engine.cache()
            self.query_one(Dashboard).off_note = note if note.startswith("auto: off") else ""
            self.refresh_info()
        stats = reply_stats(d) | {"ttft": msg.ttft}
        self.conv.messages[-1]["stats"] = stats
        self.moechat.session.replies.append(reply_record(stats, d.stop_reason, self._reply_settings))
        self.moechat.save_conversation(self.conv)
        self.moechat.save_session()
        self.bound()
        n_ctx = self.moechat.engine.info.n_ctx
        self.query_one("#status", Static).update(
            f"prompt {d.n_prompt} tok read ({d.n_kept} kept), {d.prompt_tps:.1f} t/s | reply {d.n_generated} tok, "
            f"{d.gen_tps:.1f} t/s | first token {msg.ttft:.2f} s | context {d.context}/{n_ctx} | {d.stop_reason}"
        )

    @work(thread=True, exclusive=True, group="bound")
    def bound(self) -> None:
        """MIN's hit rate on the session's lookups at this cache size: the engine replays them, off the UI thread."""
        try:
            with self.moechat.engine_lock:
                bound = self.moechat.engine.min_bound()
        except Exception as e:  # the bound is a figure on the dashboard: its failure is logged, not shown
            logger.warning("the MIN bound was not computed: %s", e)
            return
        self.post_message(BoundUpdate(bound))

    def on_bound_update(self, msg: BoundUpdate) -> None:
        self.moechat.session.set_bound(msg.bound)
        self.moechat.save_session()
        self.query_one(Dashboard).show_bound(msg.bound)

    async def on_reply_failed(self, msg: ReplyFailed) -> None:
        await self._finish("error")
        self.query_one("#status", Static).update(f"error: {msg.error}")
        self.notify(f"the engine failed: {msg.error}", severity="error", timeout=10)

    # -- actions ------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating:
            self.stop_event.set()

    async def action_regenerate(self) -> None:
        if self._loading_refused("regenerate"):
            return
        if self.generating or not self.conv.messages or self.conv.messages[-1]["role"] != "assistant":
            self.notify("nothing to regenerate", severity="warning")
            return
        self.conv.messages.pop()
        turns = self.query(Turn)
        if turns:
            await turns.last().remove()
        await self.start_reply()

    async def action_new_chat(self) -> None:
        if self.generating:
            self.notify("stop the reply first (Esc)", severity="warning")
            return
        model = self.moechat.engine.info.name if self.loaded else ""
        self.conv = Conversation(model=model, system=self.moechat.settings.system)
        await self.query(Turn).remove()
        self.first_shown = 0
        self._update_marker()
        self.query_one("#status", Static).update("new chat")

    async def load_conversation(self, conv: Conversation) -> None:
        self.conv = conv
        await self.query(Turn).remove()
        self.first_shown = max(0, len(conv.messages) - SHOWN_TURNS)
        await self.query_one("#log").mount_all([turn_for(m) for m in conv.messages[self.first_shown :]])
        self._update_marker()
        self.query_one("#status", Static).update(f"reopened: {conv.title}")

    # -- the turns shown ------------------------------------------------------------------

    async def _keep_recent(self) -> None:
        """Leave the last SHOWN_TURNS turns in the log; conv.messages keeps them all."""
        turns = list(self.query(Turn))
        extra = len(turns) - SHOWN_TURNS
        if extra > 0:
            await self.query_one("#log").remove_children(turns[:extra])
            self.first_shown += extra
            self._update_marker()

    def _update_marker(self) -> None:
        marker = self.query_one(EarlierMarker)
        marker.display = self.first_shown > 0
        n = self.first_shown
        marker.update(f"▲ {n} earlier message{'s' if n != 1 else ''}: scroll up or click to show")

    async def on_earlier_marker_clicked(self) -> None:
        await self.show_earlier()

    def _scrolled(self, y: float) -> None:
        if y <= 0 and self.first_shown > 0 and not self.generating:
            self.run_worker(self.show_earlier(), group="earlier", exclusive=True)

    async def show_earlier(self) -> None:
        """Bring back up to REVEAL_TURNS earlier turns above the oldest one shown; the view stays put."""
        if self.first_shown == 0:
            return
        start = max(0, self.first_shown - REVEAL_TURNS)
        log = self.query_one("#log", VerticalScroll)
        oldest = next(iter(self.query(Turn)), None)
        await log.mount_all([turn_for(m) for m in self.conv.messages[start : self.first_shown]],
                            after=self.query_one(EarlierMarker))  # fmt: skip
        self.first_shown = start
        self._update_marker()
        if oldest is not None:
            self.call_after_refresh(lambda: log.scroll_to(y=oldest.virtual_region.y, animate=False))

    def action_open_chat(self) -> None:
        if self.generating:
            self.notify("stop the reply first (Esc)", severity="warning")
            return

        async def opened(conv: Conversation | None) -> None:
            if conv is not None:
                await self.load_conversation(conv)

        self.app.push_screen(OpenChat(self.moechat.store.list()), opened)

    def action_settings(self) -> None:

        def done(changed: bool | None) -> None:
            if changed:
                self.conv.system = self.moechat.settings.system
                self.refresh_info()

        self.app.push_screen(SettingsDialog(self.moechat.settings), done)

    def action_tune(self) -> None:
        if self._loading_refused("the wizard runs"):
            return
        if self.moechat.attached:  # the wizard measures the machine the model runs on: the server's
            self.notify("tuning runs on the server's machine: start `moechat tune` there "
                        "(an attached app watches and chats)", severity="warning")  # fmt: skip
            return
        if self.generating:
            self.notify("stop the reply first (Esc)", severity="warning")
            return

        self.app.push_screen(TuneWizard(), lambda _: self.refresh_info())

    def action_export(self) -> None:
        if self._loading_refused("the export runs"):
            return
        self.moechat.export_all()

    def action_toggle_dashboard(self) -> None:
        dash = self.query_one(Dashboard)
        dash.display = not dash.display
