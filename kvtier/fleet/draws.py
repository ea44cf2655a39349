"""What a random tie-break draws from: a digest of the request's prompt as its client sent it.

``kvtier route --tie-break random`` ranks replicas that cost the same by a hash of the seed, this digest and
the replica's name: as random as a fresh draw per request (every distinct prompt ranks the replicas
independently and uniformly), but a function of the request, not of the order requests happened to reach the
router. ``kvtier sim``, replaying a bench run's recorded prompts, computes the same digest and so draws what
the router drew wherever the two see the same costs; with draws from a generator, the replay's draws and the
run's fell differently and a randomized arm's single prediction was off by up to a quarter (the fleet page).

The digest covers the prompt only as the router reads it: chat messages' roles and texts (``developer`` read
as ``system``, text parts joined), or a completion's text or token ids. A prompt the router cannot read
(images, a body past its decode limit) has no digest (b""): the tie-break then draws from its generator.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence


def prompt_digest(*, messages: Sequence[Mapping[str, str]] | None = None, text: str | None = None,
                  ids: Sequence[int] | None = None) -> bytes:
    """16 bytes naming the prompt: ``messages`` (each with ``role`` and ``content``), else ``text``, else
    ``ids``; b"" when none is given."""
    if messages is not None:
        value: object = ["chat", [[m.get("role", ""), m.get("content", "")] for m in messages]]
    elif text is not None:
        value = ["text", text]
    elif ids is not None:
        value = ["ids", [int(i) for i in ids]]
    else:
        return b""
    encoded = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.blake2b(encoded, digest_size=16).digest()


def draw_rank(seed: bytes, draw: bytes, replica: str) -> bytes:
    """A replica's rank in a random tie-break: the hash of the seed, the request's draw and the replica."""
    return hashlib.blake2b(seed + b"\0" + draw + b"\0" + replica.encode(), digest_size=8).digest()
