"""The ephemeral key store: single use, expiry, bounded size, refusals that say why."""

from __future__ import annotations

import pytest

from mlx_voicechat_plugin.server.keys import EphemeralKeys, KeyRefused


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_opens_once():
    keys = EphemeralKeys()
    key = keys.mint(60)
    assert key.value.startswith("ek_") and keys.check(key.value) is key
    assert keys.redeem(key.value) is key
    with pytest.raises(KeyRefused, match="already used"):
        keys.redeem(key.value)


def test_a_key_expires():
    clock = Clock()
    keys = EphemeralKeys(clock=clock)
    key = keys.mint(10)
    assert key.expires_at == 1_010.0
    clock.now = 1_010.0
    with pytest.raises(KeyRefused, match="expired"):
        keys.redeem(key.value)


def test_a_key_with_a_changed_secret_is_invalid():
    keys = EphemeralKeys()
    key = keys.mint()
    forged = key.value[:-1] + ("0" if key.value[-1] != "0" else "1")  # same id, other secret
    for token in (forged, "ek_", "sk-not-ephemeral", ""):
        with pytest.raises(KeyRefused, match="invalid"):
            keys.redeem(token)
    assert keys.redeem(key.value) is key


@pytest.mark.parametrize("seconds", [0, 9, 7201, 1.5, True, "60"])
def test_the_lifetime_is_bounded(seconds):
    with pytest.raises(ValueError, match=r"expires_after.seconds must be an integer within \[10, 7200\]"):
        EphemeralKeys().mint(seconds)


def test_the_store_is_bounded_and_forgets_expired_keys():
    clock = Clock()
    keys = EphemeralKeys(max_keys=2, clock=clock)
    keys.mint(10)
    keys.redeem(keys.mint(20).value)  # a spent key is kept until it expires: reuse is told
    with pytest.raises(OverflowError, match="2 ephemeral keys are unexpired"):
        keys.mint(10)
    clock.now += 15
    assert len(keys) == 1
    keys.mint(10)
