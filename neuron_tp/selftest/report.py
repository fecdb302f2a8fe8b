"""The selftest's results: one :class:`Check` per line of the report, as text or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, INFO = "PASS", "FAIL", "INFO"


@dataclass
class Check:
    """One check of the selftest: its name, verdict, the numbers it measured and, when it
    failed, what the failure means and what to try (``hint``)."""

    name: str
    status: str = PASS
    summary: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # one line per wrong result
    hint: str = ""
    seconds: float = 0.0
    table: list[str] = field(default_factory=list)  # extra lines printed under the check

    def fail(self, line: str) -> None:
        """Record one wrong result (the check then fails)."""
        self.status = FAIL
        self.failures.append(line)

    @property
    def ok(self) -> bool:
        return self.status != FAIL

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Check:
        return cls(**d)


SHOWN = 6  # failure lines printed per check (all of them are in the JSON)


def check_lines(c: Check) -> list[str]:
    """The text of one check: its line, then its table, its failures and its hint."""
    lines = [f"{c.status:<4} {c.name:<12} {c.summary} ({c.seconds:.1f} s)"]
    lines += [f"     {t}" for t in c.table]
    lines += [f"     - {f}" for f in c.failures[:SHOWN]]
    if len(c.failures) > SHOWN:
        lines.append(f"     ... and {len(c.failures) - SHOWN} more (--json lists them all)")
    if c.hint and not c.ok:
        lines.append(f"     what to try: {c.hint}")
    return lines


def verdict(checks: list[Check], seconds: float) -> str:
    """The report's last line."""
    bad = [c.name for c in checks if not c.ok]
    if bad:
        return f"selftest: FAIL ({', '.join(bad)}) in {seconds:.1f} s"
    return f"selftest: PASS ({len(checks)} checks) in {seconds:.1f} s"


def report_json(checks: list[Check], facts: dict, seconds: float) -> str:
    """The whole report as JSON (for tools and bug reports)."""
    return json.dumps(
        {
            "ok": all(c.ok for c in checks),
            "seconds": seconds,
            "facts": facts,
            "checks": [c.to_dict() for c in checks],
        },
        indent=1,
        default=str,
    )
