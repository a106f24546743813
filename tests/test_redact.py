from __future__ import annotations

from guest_runner.redact import MASK, Redactor, name_looks_secret


def test_names_that_look_secret():
    for n in (
        "GITHUB_TOKEN",
        "db_password",
        "API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY_ID",
        "AWS_SESSION_TOKEN",
        "MY_SECRET",
        "PRIVATE_KEY_PEM",
    ):
        assert name_looks_secret(n), n
    for n in ("PATH", "HOME", "LANG", "RESOLUTO_RUN_ID", "AWS_REGION"):
        assert not name_looks_secret(n), n


def test_env_values_and_declared_values_are_masked_everywhere():
    env = {
        "GITHUB_TOKEN": "ghp_abcdef123",
        "PLAIN": "visible",
        "CUSTOM": "hunter22",
        "RESOLUTO_SECRET_ENV": '["CUSTOM"]',
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI",
    }
    r = Redactor.from_env(env)
    line = "token=ghp_abcdef123 pass=hunter22 aws=wJalrXUtnFEMI plain=visible"
    assert r.text(line) == f"token={MASK} pass={MASK} aws={MASK} plain=visible"
    data = {
        "argv": ["curl", "-H", "Bearer ghp_abcdef123"],
        "api_key": "whatever",
        "n": 3,
        "nested": {"password": "x", "ok": "hunter22!"},
    }
    assert r.data(data) == {
        "argv": ["curl", "-H", f"Bearer {MASK}"],
        "api_key": MASK,
        "n": 3,
        "nested": {"password": MASK, "ok": f"{MASK}!"},
    }


def test_longest_secret_wins_and_short_values_are_not_secrets():
    r = Redactor(["abcd", "abcdefgh", "1"])
    assert r.text("xabcdefghx abcd 1") == f"x{MASK}x {MASK} 1"
    assert Redactor().text("unchanged") == "unchanged"
