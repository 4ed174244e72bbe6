"""Speculative decoding: propose draft tokens cheaply, verify them in one target forward pass.

- ``config.py``: what to speculate with (n-gram prompt lookup or a draft model) and how far.
- ``ngram.py``: drafts copied from earlier context (prompt lookup).
- ``draft_model.py``: drafts from a smaller checkpoint of the same vocabulary.
- ``medusa.py``, ``eagle.py``: drafts from the target's own hidden states, proposed after each
  step (Medusa's heads; EAGLE's one-layer decoder over the target's features, with a draft KV
  of its own, EAGLE-1/2's model in ``eagle_draft.py``, EAGLE-3's in ``eagle3_draft.py``); their
  checkpoints in ``medusa_checkpoint.py``, ``eagle_checkpoint.py`` and ``eagle3_checkpoint.py``.
- ``rejection_sampler.py``: accepts a prefix of the drafts and adds one token, so the output
  distribution is the target's (greedy: token for token the non-speculative output).
- ``stats.py``: draft and accepted token counts, for the load report and metrics.

One step of a speculating request, in call order:

1. ``EngineCore.step`` (before scheduling): the proposer sets ``request.num_spec_tokens``
   (and, for n-gram, ``request.spec_token_ids``; Medusa and EAGLE proposed theirs after the
   request's last step) on each running request that decodes.
2. ``Scheduler.schedule``: schedules ``1 + num_draft_tokens`` tokens for it (slots allocated,
   inside the step's token budget; the drafts are dropped first when blocks run short).
3. ``ModelRunner.execute``: the draft model, if any, fills ``spec_token_ids`` for its
   scheduled drafts; one target forward computes logits at every draft position (each draft
   position attends as a decode row of its own); ``RejectionSampler`` accepts a prefix.
4. ``Scheduler.update``: appends the accepted drafts and the bonus/recovered token, rolls
   ``num_computed_tokens`` back past the rejected drafts and frees any block that held only
   rejected positions, so the pool holds exactly what a non-speculative run would.
"""
