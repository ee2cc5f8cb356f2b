"""What reaches the user: plurals, error codes summed over rows, and which warnings.

An error row's `error` is `"<code>: <message>"`; the code alone names what went wrong
(`truncated`, `unknown_format`, `too_large`, ...), so statistics count codes and the
summary line and `embedjob status` name the most frequent ones.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

SHOWN_CODES = 10
"""Error codes a summary line names; the rest (an output with more kinds of failure
than a line can hold) are counted as "N more". Ten: the decoders' codes rarely come
to that many, so a summary names every code a user must look at."""

HIGH_ERROR_SHARE = 0.1
"""The share of error rows above which a finished shard is flagged (`status`, `verify`,
the report): below `runtime.max_error_rate`, so it finished, but a user should look at
its input before trusting its output."""


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`1 error`, `2 errors` (`many` for nouns that do not just take an s)."""
    return f"{count} {noun if count == 1 else (many or noun + 's')}"


def error_code(error: str) -> str:
    """The code of an error row's `"<code>: <message>"`."""
    return error.split(":", 1)[0].strip()


def count_errors(errors: Iterable[str | None]) -> dict[str, int]:
    """Error rows per code, most frequent first (rows without an error are skipped)."""
    return dict(Counter(error_code(e) for e in errors if e is not None).most_common())


def route_warnings(verbose: bool) -> None:
    """Python warnings (torch's UserWarnings and the like) are about the libraries, not
    the job: they become log records that only a verbose log shows, instead of text on
    stderr between the job's lines. For the processes embedjob starts and owns (the
    command, its ranks); `embedjob.run` leaves its caller's warnings alone."""
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.WARNING if verbose else logging.CRITICAL)


def codes_text(codes: dict[str, int], shown: int = SHOWN_CODES) -> str:
    """`truncated 5, unknown_format 2, 1 more code` from code counts (most frequent first)."""
    ordered = sorted(codes.items(), key=lambda item: (-item[1], item[0]))
    text = ", ".join(f"{code} {count}" for code, count in ordered[:shown])
    rest = len(ordered) - shown
    return text + (f", {plural(rest, 'more code')}" if rest > 0 else "")


def error_share_warning(shard: int, errors: int, rows: int, codes: dict[str, int]) -> str | None:
    """One line flagging a finished shard whose rows are errors more often than
    HIGH_ERROR_SHARE, naming its codes; None when it is below."""
    if rows <= 0 or errors <= HIGH_ERROR_SHARE * rows:
        return None
    named = f": {codes_text(codes)}" if codes else ""
    return (
        f"shard {shard} finished with {errors} of {plural(rows, 'row')} as errors ({errors / rows:.0%}, over "
        f"{HIGH_ERROR_SHARE:.0%}{named}); check its input (input.media_root, input.media_column) before using it"
    )
