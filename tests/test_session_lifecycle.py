"""A session's lifecycle (issue 51): each transition one method of the Session, each move the
table does not allow refused, and nothing else writes the states.

The engine side: new -> opening -> open -> closing -> closed (a re-open goes back to
new); the link side: unlinked -> attached -> detached -> claimed -> attached, and
released from anywhere. Driven on a real engine (tiny checkpoint) over the in-memory
transport, with no socket.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from test_session_transport import engine  # noqa: F401  (the fixture: a real engine)

from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.server.connection import Connection, connect
from mlx_voicechat_plugin.server.dialects import VLM
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.session.lifecycle import (
    ENGINE_MOVES, LINK_MOVES, Lifecycle, Stage, Tie, TransitionRefused,
)
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.session.session import Session
from mlx_voicechat_plugin.server.transport.memory import MemoryTransport
from mlx_voicechat_plugin.server.wire import ProtocolError

SERVER = Path(__file__).resolve().parents[1] / "mlx_voicechat_plugin" / "server"
STATES = ("stage", "tie")


def session_of(engine: Engine) -> Session:
    return Session(engine, ServerLimits(), VLM, "tiny")


class Link:
    """A link that keeps nothing (the session's attach needs one)."""

    def send(self, message) -> None:
        pass

    def replay(self, messages) -> None:
        pass

    async def watch(self, opening: asyncio.Future) -> None:
        await asyncio.wait({opening})

    def supersede(self) -> None:
        pass


# --- the tables -----------------------------------------------------------------------


SIDES = {"stage": (ENGINE_MOVES, Lifecycle.move_engine),  # the engine side
         "tie": (LINK_MOVES, Lifecycle.move_link)}  # the link side
MOVES = [(side, start, to) for side, (table, _) in SIDES.items() for start in table
         for to in table]


@pytest.mark.parametrize("side, start, to", MOVES)
def test_each_side_moves_only_as_its_table_says(side, start, to):
    table, move = SIDES[side]
    life = Lifecycle("s")
    setattr(life, side, start)
    if to in table[start]:
        move(life, to)
        assert getattr(life, side) is to
    else:
        with pytest.raises(TransitionRefused, match=f"from {start.value} to {to.value}"):
            move(life, to)
        assert getattr(life, side) is start


def test_closed_and_released_are_final():
    assert not ENGINE_MOVES[Stage.CLOSED] and not LINK_MOVES[Tie.RELEASED]


# --- each transition is one method of the Session ----------------------------------------


def test_a_new_session_is_new_and_unlinked_and_builds_its_dialect(engine):
    async def scenario():
        session = session_of(engine)
        assert (session.life.stage, session.life.tie) == (Stage.NEW, Tie.UNLINKED)
        assert isinstance(session.dialect, VLM) and session.dialect.session is session
        await session.release()
        return session.life.stage, session.life.tie
    assert asyncio.run(scenario()) == (Stage.CLOSED, Tie.RELEASED)


def test_open_session_goes_through_opening_to_open_and_release_through_closing(engine):
    async def scenario():
        session = session_of(engine)
        session.attach(Link())
        seen = []
        task = asyncio.ensure_future(session.open_session(ConversationOptions()))
        await asyncio.sleep(0)
        seen.append(session.life.stage)
        await task
        seen.append(session.life.stage)
        session.let_go()
        seen.append(session.life.stage)
        await session.release()
        seen.append(session.life.stage)
        return seen
    assert asyncio.run(scenario()) == [Stage.OPENING, Stage.OPEN, Stage.CLOSING, Stage.CLOSED]


def test_a_session_let_go_while_it_opens_is_not_opened_and_leaves_nothing(engine):
    async def scenario():
        session = session_of(engine)
        session.attach(Link())
        opening = asyncio.ensure_future(session.open_session(ConversationOptions()))
        await asyncio.sleep(0)
        session.let_go()  # e.g. a detached session's slot taken while it re-opens
        with pytest.raises(ProtocolError):
            await opening
        stage = session.life.stage
        await session.release()
        return stage, session.life.stage, session.session_id in engine.stepper.channels
    assert asyncio.run(scenario()) == (Stage.CLOSING, Stage.CLOSED, False)


def test_a_session_whose_client_left_is_not_opened_again(engine):
    async def scenario():
        session = session_of(engine)
        session.attach(Link())
        session.let_go()
        await session.release()
        with pytest.raises(ProtocolError, match="closing"):
            await session.open_session(ConversationOptions())
    asyncio.run(scenario())


def test_attach_detach_claim_unclaim_attach_release(engine):
    async def scenario():
        session = session_of(engine)
        seen = [session.life.tie]
        session.attach(Link())
        seen.append(session.life.tie)
        session.detach()
        seen.append(session.life.tie)
        session.claim()
        seen.append(session.life.tie)
        session.unclaim()
        seen.append(session.life.tie)
        session.claim()
        session.attach(Link())
        seen.append(session.life.tie)
        await session.release()
        seen.append(session.life.tie)
        return seen
    assert asyncio.run(scenario()) == [Tie.UNLINKED, Tie.ATTACHED, Tie.DETACHED, Tie.CLAIMED,
                                       Tie.DETACHED, Tie.ATTACHED, Tie.RELEASED]


def test_refused_link_moves(engine):
    async def scenario():
        session = session_of(engine)
        with pytest.raises(TransitionRefused):
            session.claim()  # nothing to resume: never detached
        session.attach(Link())
        with pytest.raises(TransitionRefused):
            session.attach(Link())  # another link carries it
        with pytest.raises(TransitionRefused):
            session.claim()  # attached: a resume takes it over first (Resumes.take_over)
        session.detach()
        session.claim()
        with pytest.raises(TransitionRefused):
            session.claim()  # another resume is being accepted
        await session.release()
        with pytest.raises(RuntimeError, match="released"):
            session.attach(Link())
        with pytest.raises(TransitionRefused):
            session.claim()
        session.detach()  # a released session stays released
        session.unclaim()
        return session.life.tie
    assert asyncio.run(scenario()) is Tie.RELEASED


def test_a_connection_drives_the_states_through_the_session(engine):
    async def scenario():
        transport = MemoryTransport()
        connection = connect(transport, VLM, engine, "tiny", ServerLimits())
        session = connection.session
        task = asyncio.ensure_future(connection.run())
        await transport.take()
        seen = [(session.life.stage, session.life.tie)]
        transport.put({"type": "session.update", "session": {}})
        await transport.take()
        seen.append((session.life.stage, session.life.tie))
        transport.hang_up()
        await asyncio.wait_for(task, 10)
        seen.append((session.life.stage, session.life.tie))
        return seen
    assert asyncio.run(scenario()) == [(Stage.NEW, Tie.ATTACHED), (Stage.OPEN, Tie.ATTACHED),
                                       (Stage.CLOSED, Tie.RELEASED)]


def test_a_resumed_connection_attaches_a_detached_session(engine):
    async def scenario():
        first = MemoryTransport()
        connection = connect(first, VLM, engine, "tiny", ServerLimits())
        session = connection.session
        session.outlive_transports()
        task = asyncio.ensure_future(connection.run())
        await first.take()
        first.put({"type": "session.update", "session": {}})
        await first.take()
        first.hang_up(1006)
        await asyncio.wait_for(task, 10)
        detached = session.life.tie
        session.claim()
        second = MemoryTransport()
        task = asyncio.ensure_future(Connection(second, session, resumed=True).run())
        await second.take()
        attached = session.life.tie
        second.hang_up()
        await asyncio.wait_for(task, 10)
        return detached, attached
    assert asyncio.run(scenario()) == (Tie.DETACHED, Tie.ATTACHED)


# --- nothing outside the Session writes its states ---------------------------------------


def test_no_module_but_the_session_writes_its_states():
    """No assignment to a session's lifecycle, its states or its old flags outside
    session.py / lifecycle.py."""
    written = {"life", "stage", "tie", "is_open", "opening_or_open", "detached_or_claimed",
               "claimed", "configured", "open", "detached",
               "released", "outlives_transport", "keep_alive", "dialect", "resume_token"}
    offenders = []
    for path in SERVER.rglob("*.py"):
        if path.name in ("session.py", "lifecycle.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in written \
                            and isinstance(leaf.value, (ast.Name, ast.Attribute)) \
                            and "session" in ast.unparse(leaf.value):
                        offenders.append(f"{path.name}:{node.lineno} {ast.unparse(leaf)}")
    assert offenders == []
