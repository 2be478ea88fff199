"""Model names on the OpenAI Realtime GA route: any ``?model=`` is served as the served id
(GA clients ask for ``gpt-realtime`` by default), unless ``--strict-model``; ``--alias``
may be given more than once (the first is the id reported, each a name accepted)."""

from __future__ import annotations

import pytest
from ga_support import API_KEY, MODEL
from server_support import LiveServer, connect, recv, running
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.cli import serve
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.routes.models import ServedModel

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMITS = ServerLimits(update_timeout=5, idle_timeout=5)
ALIASES = ["voice-a", "voice-b"]


@pytest.fixture(scope="module")
def lenient(tiny_ckpt):
    yield from running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=LIMITS)))


@pytest.fixture(scope="module")
def strict(tiny_ckpt):
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=LIMITS, alias=ALIASES,
                     strict_model=True)
    yield from running(LiveServer(app))


def _created(server: LiveServer, model: str) -> dict:
    server.wait_idle()
    with connect(server.ws(f"/openai/v1/realtime?model={model}"),
                 additional_headers=AUTH) as ws:
        return recv(ws)


@pytest.mark.parametrize("model", ["gpt-realtime", "gpt-4o-realtime-preview", MODEL])
def test_any_model_is_served_as_the_served_id(lenient, model):
    created = _created(lenient, model)
    assert created["type"] == "session.created" and created["session"]["model"] == MODEL


def test_the_mlx_vlm_route_still_names_only_the_served_model(lenient):
    with pytest.raises(InvalidStatus) as refused:
        connect(lenient.ws("/v1/realtime?model=gpt-realtime"), additional_headers=AUTH)
    assert refused.value.response.status_code == 404


def test_strict_model_refuses_another_name_naming_the_served_id(strict):
    with pytest.raises(InvalidStatus) as refused:
        connect(strict.ws("/openai/v1/realtime?model=gpt-realtime"), additional_headers=AUTH)
    assert refused.value.response.status_code == 404
    assert b"voice-a" in refused.value.response.body


@pytest.mark.parametrize("model", ALIASES + [MODEL])
def test_every_alias_and_the_checkpoints_name_are_accepted_under_strict_model(strict, model):
    created = _created(strict, model)
    assert created["session"]["model"] == "voice-a"  # the first alias is the id reported


def test_served_names():
    served = ServedModel.of("/ckpts/tiny", ["a", "b"], strict=True)
    assert served.model_id == "a" and served.names[:2] == ("a", "b")
    assert served.accepts(None) and served.accepts("b", any_name=True)
    assert not served.accepts("gpt-realtime", any_name=True)
    assert ServedModel.of("/ckpts/tiny").accepts("gpt-realtime", any_name=True)
    assert not ServedModel.of("/ckpts/tiny").accepts("gpt-realtime")


def test_the_flags_parse():
    args = serve.parse(["-m", "ckpt", "--alias", "a", "--alias", "b", "--strict-model"],
                       "serve", False)
    assert (args.alias, args.strict_model) == (["a", "b"], True)
    args = serve.parse(["-m", "ckpt"], "serve", False)
    assert (args.alias, args.strict_model) == (None, False)
