"""Text from a sandbox, made inert in the markdown the host writes (issue 39, finding 5).

The runner's artifacts carry a sandbox's words (an exception's message, an output's name, a
reason quoting the guest) under the runner's name, and the Prefect UI renders an artifact's
description, and a table's cells, as markdown. Raw, ``[Sandbox verified - click to
approve](http://...)`` is a live link there and ``![](http://...)`` a tracking image.

Every ASCII punctuation character is backslash-escaped (CommonMark's escapes, which GFM
renderers follow), so no link, image, autolink, HTML tag, entity, emphasis, code span,
heading, list or table delimiter can form; the ``:``, ``/`` and ``.`` of a URL escaped
keep a GFM renderer from linking a bare ``http://`` or ``www.`` too. Control characters and
line breaks become spaces: a cell is one line. What renders is the text as written.
"""

from __future__ import annotations

import re

_PUNCTUATION = re.compile(r"""([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~])""")
_BREAKS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def inert(text: str) -> str:
    """``text`` as markdown that renders exactly as ``text`` reads, on one line."""
    return _PUNCTUATION.sub(r"\\\1", " ".join(_BREAKS.sub(" ", text).split()))
