"""A generated table in a docs page, kept true by a test: the test compares the page's table
with what it found, or rewrites the page when the environment variable ``env`` is ``1``."""

from __future__ import annotations

import os


def check_docs_table(page: str, want: str, have: str | None, env: str, test: str) -> None:
    """``page``'s table ``have`` (None: none found) must equal ``want``; with ``env=1`` the page
    is rewritten from ``want`` instead. ``test``: the test file that regenerates it."""
    if os.environ.get(env) == "1":
        assert have is not None, f"{page} has no generated table to replace"
        with open(page) as f:
            text = f.read()
        with open(page, "w") as f:
            f.write(text.replace(have, want))
        return
    stale = sorted(set((have or "").splitlines()) ^ set(want.splitlines()))
    assert have == want, (
        f"{os.path.basename(page)}'s table differs from what the test finds (rewrite it with "
        f"{env}=1 pytest {test}); lines that differ:\n" + "\n".join(stale)
    )
