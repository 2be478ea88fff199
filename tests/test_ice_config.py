"""ICE settings of the WebRTC calls: host addresses and STUN/TURN servers, read once, checked."""

from __future__ import annotations

import asyncio

import pytest

from mlx_voicechat_plugin.server.transport.ice import ICEConfig, ICEServer, gathering_on


def test_from_dict_reads_hosts_and_servers():
    ice = ICEConfig.from_dict({"hosts": ["127.0.0.1", "::1"],
                               "servers": ["stun:stun.example.org:3478",
                                           "turn:user:p%40ss@turn.example.org:3478"]})
    assert ice.hosts == ("127.0.0.1", "::1")
    assert ice.servers == (ICEServer("stun:stun.example.org:3478"),
                           ICEServer("turn:turn.example.org:3478", "user", "p@ss"))
    assert ICEConfig.from_dict(None) == ICEConfig()


@pytest.mark.parametrize("values, message", [
    ({"hosts": ["localhost"]}, "ice_hosts: 'localhost' is not an IP address"),
    ({"servers": ["http://example.org"]}, "ice_servers: 'http://example.org' must be"),
    ({"servers": ["stun:user:pw@example.org"]}, "only a turn: URL carries"),
    ({"host": ["127.0.0.1"]}, "unknown ICE settings"),
])
def test_bad_settings_name_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        ICEConfig.from_dict(values)


def test_no_server_means_none_is_asked():
    pytest.importorskip("aiortc")
    assert ICEConfig().rtc_configuration().iceServers == []


def test_gathering_uses_the_hosts_only_within_its_context():
    pytest.importorskip("aiortc")
    from aiortc import RTCConfiguration, RTCPeerConnection

    async def candidates(hosts: tuple[str, ...] | None) -> set[str]:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.createDataChannel("oai-events")
        if hosts is None:
            await pc.setLocalDescription(await pc.createOffer())
        else:
            with gathering_on(hosts):
                await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return {line.split()[4] for line in sdp.splitlines() if line.startswith("a=candidate")}

    assert asyncio.run(candidates(("127.0.0.1",))) == {"127.0.0.1"}
    assert "127.0.0.1" not in asyncio.run(candidates(None))  # aioice's own choice outside
