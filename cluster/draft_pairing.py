"""Which drafters may pair across the prefill/decode hand-off.

A fingerprint's ``draft`` names the drafter whose proposals cross the hand-off with the KV:
Medusa heads (``"medusa:" + <the heads' identity>``), an EAGLE draft (``"eagle:" + <the draft
checkpoint's identity>``) or an EAGLE-3 draft (``"eagle3:" + <its identity>``), since P runs them
once after the prompt's first token and puts their drafts in the signed KV handle for D to verify
(and, for EAGLE and EAGLE-3, the draft's KV over the prompt in the pull, for D's draft to attend
over). Other methods draft on D from D's own state, so their fingerprint's ``draft`` is empty.

Two different drafters never pair: D would verify drafts from a drafter it does not have
(wasted work at best), and attend over another draft's KV (an EAGLE and an EAGLE-3 draft never
pair: their prefixes differ). An empty one on either side pairs:
a P without a drafter sends no drafts, a D without one ignores P's. The instances' check
(``kv_connector/fingerprint.py``) and the gateway's pairing (``gateway/instances.py``) both ask
:func:`drafts_pair`, so the gateway never pairs what the instances would refuse. It lives here
because the gateway never imports the kv_connector.
"""

from __future__ import annotations

MEDUSA_DRAFT_PREFIX = "medusa:"
EAGLE_DRAFT_PREFIX = "eagle:"
EAGLE3_DRAFT_PREFIX = "eagle3:"


def drafts_pair(mine: str, theirs: str) -> bool:
    """Whether instances with these fingerprint drafts may pair: equal, or either one empty."""
    return not mine or not theirs or mine == theirs
