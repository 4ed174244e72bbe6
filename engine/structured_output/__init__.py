"""Structured outputs (guided decoding): a grammar decides which tokens may come next.

Built on llguidance (torch-free, so the gateway can compile and validate grammars
without importing torch). The pieces, one concept each:

- ``spec``: what a request asks for (``StructuredOutputSpec``), torch- and llguidance-free.
- ``compiler``: a spec to a compiled grammar, cached by (kind, spec) in a bounded LRU;
  a bad spec is a ``ValueError`` naming the problem. The gateway and every instance own one.
- ``grammar_state``: one request's matcher, advanced over each token it outputs.
- ``bitmask``: the engine's side: allowed-token bitmasks computed on a worker thread
  while the forward pass runs, applied to the logits batched.
"""

from engine.structured_output.spec import StructuredOutputKind, StructuredOutputSpec

__all__ = ["StructuredOutputKind", "StructuredOutputSpec"]
