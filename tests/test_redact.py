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


# --------------------------------------------------------------------------- shapes

import base64  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from urllib.parse import quote, quote_plus  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from guest_runner.redact import MIN_SECRET_LEN, too_short  # noqa: E402

PEM = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "QyNTUxOQAAACDx2mW4Wq0rJ9v6c9jz0S8y5lq6dXc9Yq2HnV1m4c3hAAAAJhs1pYdbNaW\n"
    "HQAAAAtzc2gtZWQyNTUxOQAAACDx2mW4Wq0rJ9v6c9jz0S8y5lq6dXc9Yq2HnV1m4c3hA\n"
    "AAAEB\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)


def _b64_in_stream(s: str, k: int, tail: bytes = b"tail") -> str:
    return base64.b64encode(b"p" * k + s.encode() + tail).decode()


ENCODINGS: dict[str, Callable[[str], str]] = {
    "raw": lambda s: s,
    "json": lambda s: json.dumps(s)[1:-1],
    "json-unicode": lambda s: json.dumps(s, ensure_ascii=False)[1:-1],
    "repr": lambda s: repr(s)[1:-1],
    "quote": lambda s: quote(s, safe=""),
    "quote-slash": quote,
    "quote_plus": quote_plus,
    "b64": lambda s: base64.b64encode(s.encode()).decode(),
    "b64-nopad": lambda s: base64.b64encode(s.encode()).decode().rstrip("="),
    "b64-urlsafe": lambda s: base64.urlsafe_b64encode(s.encode()).decode(),
    "b64-urlsafe-nopad": lambda s: base64.urlsafe_b64encode(s.encode()).decode().rstrip("="),
}


def test_every_line_of_a_multi_line_secret_is_masked_line_by_line() -> None:
    r = Redactor([PEM])
    for line in PEM.splitlines():
        assert line not in r.text(f"out: {line}"), line
    # as one JSON string (a log of a dict holding the key) too
    assert "b3BlbnNzaC1rZXktdjEAAAAABG5" not in r.text(json.dumps({"key": PEM}))


def test_each_shape_of_a_secret_is_masked() -> None:
    secret = "s3cr3t/with spaces&+=üñí"
    r = Redactor([secret])
    for name, enc in ENCODINGS.items():
        shown = enc(secret)
        assert shown not in r.text(f"x {shown} y"), name
    for k in range(3):
        stream = _b64_in_stream(secret, k)
        out = r.text(stream)
        assert MASK in out, k
        # what is left of the stream decodes to no more than 2 bytes of the secret's ends
        assert base64.b64encode(secret.encode()[1:-1]).decode()[1:-1] not in out


def test_declared_secrets_too_short_are_named() -> None:
    assert too_short({"A": "abc", "B": "abcd", "C": "", "D": "x"}) == ["A", "D"]
    assert MIN_SECRET_LEN == 4


def test_short_lines_of_a_multi_line_secret_are_not_shapes() -> None:
    r = Redactor(["line-one-long\n\nab\n"])
    # the empty line and 'ab' would mask ordinary text: they are left alone
    assert r.text("ab cd") == "ab cd"
    assert r.text("line-one-long") == MASK


_alphabet = st.characters(min_codepoint=32, max_codepoint=0x2FF, blacklist_categories=("Cs",))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    secret=st.text(_alphabet, min_size=MIN_SECRET_LEN, max_size=40),
    before=st.text(_alphabet, max_size=20),
    after=st.text(_alphabet, max_size=20),
    encoding=st.sampled_from(sorted(ENCODINGS)),
)
def test_property_an_encoded_secret_never_survives(
    secret: str, before: str, after: str, encoding: str
) -> None:
    shown = ENCODINGS[encoding](secret)
    assert shown not in Redactor([secret]).text(before + shown + after)


@settings(max_examples=150, deadline=None)
@given(
    secret=st.binary(min_size=MIN_SECRET_LEN, max_size=40).map(lambda b: b.hex()),
    before=st.binary(max_size=12),
    after=st.binary(max_size=12),
    urlsafe=st.booleans(),
)
def test_property_a_secret_inside_a_base64_stream_is_masked(
    secret: str, before: bytes, after: bytes, urlsafe: bool
) -> None:
    enc = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    stream = enc(before + secret.encode() + after).decode()
    out = Redactor([secret]).text(stream)
    assert MASK in out
    # No 3 consecutive bytes of the secret decode from what is left: at most the edges leak.
    k = len(before) % 3
    core_start = -(-8 * len(before) // 6)
    core_stop = (8 * (len(before) + len(secret))) // 6
    assert stream[core_start:core_stop] not in out, k


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(
        st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=MIN_SECRET_LEN, max_size=64),
        min_size=2,
        max_size=6,
    ),
    pick=st.integers(min_value=0),
)
def test_property_any_line_of_a_multi_line_secret_is_masked(lines: list[str], pick: int) -> None:
    secret = "\n".join(lines) + "\n"
    line = lines[pick % len(lines)]
    assert line not in Redactor([secret]).text(f"[task] {line} [end]")


def test_base64_wrapped_as_pem_mime_and_the_base64_tool_print_it_is_masked_line_by_line() -> None:
    r = Redactor([PEM])
    raw = PEM.encode()
    wrapped = base64.encodebytes(raw).decode().splitlines()  # 76 columns, as `base64` prints
    pem_style = base64.b64encode(raw).decode()
    pem_style_lines = [pem_style[i : i + 64] for i in range(0, len(pem_style), 64)]
    for line in wrapped + pem_style_lines:
        assert line not in r.text(f"> {line}"), line
